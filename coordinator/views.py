"""Read-only views of the scheduler for the HTTP front: /metrics JSON, /health, /slots."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import Scheduler


def live_metrics(sched: Scheduler) -> dict:
    """The `/metrics?format=json` live view (Engine.live_metrics)."""
    running = sum(1 for j in sched.jobs if j is not None)
    slots = []
    for s in range(sched.parallel):
        job, conv = sched.jobs[s], sched.held.get(s)
        state = "busy" if job else ("held" if conv else "free")
        tokens = job.fed if job else (len(conv.tokens) if conv else 0)
        slots.append({"slot": s, "state": state, "cells": sched.map.held_cells(s), "tokens": tokens})
    parked = [
        {"table": t, "cells": sched.map.held_cells(t), "tokens": len(c.tokens)}
        for t, c in sched.held.items()
        if t >= sched.parallel
    ]
    return {
        "running": running,
        "waiting": len(sched.waiting),
        "coordinator_cpu_s": round(time.process_time(), 4),  # this process, every thread (bench serve: per token)
        "kv_pool": {
            "enabled": sched.cfg.engine.pool_on,
            "cells": sched.map.total_cells,
            "free": sched.map.free_cells,
            "chunk_cells": sched.cfg.engine.chunk_cells,
            # Prefix sharing (pool/chunk_map.py rule 10): cells in chunks more than one table holds, and the
            # cells the tables would hold on top without sharing. free + sum(held) = cells + saved.
            "share_prefixes": sched.sharing,
            "shared": sched.map.shared_cells,
            "saved": sched.map.saved_cells,
            "slots": slots,
            "parked": parked,
        },
        "counters": {**sched.counters, **sched.cache.counters, "refusals": dict(sched.counters["refusals"])},
        "kv_window": kv_window(sched),
        "stages": stage_time(sched),
        "pipeline_groups": sched.groups,  # steps computed at once (pool/pipeline.py rule 6)
    }


def stage_time(sched: Scheduler) -> list[dict]:
    """Per stage, as of its last PONG: steps run, refused (a stale table version, a chain it cannot fill) and
    failed (an error while computing), seconds computing steps (busy_s) and seconds a step waited for the previous
    stage's hidden states (hidden_wait_s), times its sockets changed threads (baton_passes); a stage that has not
    answered a PING has no entry."""
    return [{"stage": s["index"], "steps_run": s["steps_run"], "steps_refused": s.get("steps_refused", 0),
             "steps_failed": s.get("steps_failed", 0), "busy_s": s.get("busy_s", 0.0),
             "hidden_wait_s": s.get("hidden_wait_s", 0.0), "baton_passes": s.get("baton_passes", 0),
             "weight_bytes": s.get("weight_bytes")}
            for s in sched.link.stage_info() if "steps_run" in s]

def kv_window(sched: Scheduler) -> list[dict]:
    """Per stage with a device window, as of its last PONG: {"stage": i, frames, cells, ..., counters}.

    A stage that is down, or has not answered a PING yet, has no entry (its PONG is the only source)."""
    return [{"stage": s["index"], **s["kv_window"]} for s in sched.link.stage_info() if s.get("kv_window")]

def health(sched: Scheduler) -> dict:
    up = list(sched.link.stages_up)
    return {
        "status": "ok" if all(up) else "degraded",
        "stages": [{"index": i, "up": u, "layers": list(s.layers)} for i, (u, s) in enumerate(zip(up, sched.cfg.stages))],
    }

def slots(sched: Scheduler) -> list[dict]:
    """llama.cpp's `/slots`: one entry per slot."""
    out = []
    for s in range(sched.parallel):
        job, conv = sched.jobs[s], sched.held.get(s)
        out.append(
            {
                "id": s,
                "is_processing": job is not None,
                "n_ctx": sched.max_context,
                "n_past": job.fed if job else (len(conv.tokens) if conv else 0),
                "cells": sched.map.held_cells(s),
                "id_task": job.req.request_id if job else None,
            }
        )
    return out
