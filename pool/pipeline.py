"""How the stages of a layer split share the steps: pipelined, or in turns.

A step passes through every stage in order. With S stages the scheduler can keep them busy in two ways:

- pipelined: up to S steps in flight, the decoding slots split into S groups (ceil(active / S) per step), so
  each stage computes a different step at the same time. Stages with compute of their own (a GPU each, CPU
  stages on different machines) need this, or S - 1 of them would idle.
- in turns: one step in flight; each stage computes it with all of the machine's cores while the others wait.
  CPU stages on one machine share its cores and its memory bus, so computing at once buys them nothing: a
  stage gets 1 / S of the cores, and S groups of decoders read every stage's weights S times per token where
  one group reads them once (a decode step is a read of the weights). Measured on two CPU stages of one
  2-core machine (docs/BENCHMARKS.md, "Two CPU stages take turns"): over the mixed workload two stages kept
  0.68-0.77x of one stage's throughput pipelined and 0.76-0.93x in turns.

Rules:
1. `engine.pipeline`: true pipelines, false takes turns; auto (the default) takes turns when there are several
   stages and all of them are CPU stages on one machine (`machine`: by their endpoints), and pipelines
   otherwise (one stage: both are the same).
2. `groups(cfg)` is how many steps the scheduler keeps in flight (chained steps, pool/step_chain.py, add one)
   and how many groups its decoding slots are split into: S pipelined, 1 in turns. Prefill pieces are cut for
   that many groups (coordinator/prefill_pieces.py): in turns a prompt is read as on one stage.
3. Threads (stages/runner.py `stage_threads`, with `engine.threads` 0): in turns a CPU stage takes all of its
   machine's cores, since only one computes at a time; pipelined, the machine's cores are split evenly between
   the CPU stages the config puts on it.
4. In turns with the ring (`chain_steps: true`), the one more step in flight must carry a chained row: it then
   waits at the first stage for the samples of the step before it, so still only one stage computes. A step
   without one waits for the step in flight to come back.
5. OpenMP's wait (`spin_env`): a CPU stage in turns starts with GOMP_SPINCOUNT=SPIN_TURNS, unless its
   environment sets GOMP_SPINCOUNT or OMP_WAIT_POLICY. After a parallel region, libgomp's threads by default
   spin for 300,000 pauses before they sleep, milliseconds on current x86 cores: at the end of each step the
   stage that just computed would keep spinning on the cores the next stage needs. SPIN_TURNS pauses still
   cover the gaps between a step's products. The mixed workload on two stages in turns, two rounds:
   36.5 / 37.8 s as shipped, 34.2 / 33.4 s with it (docs/BENCHMARKS.md).
6. `/metrics` reports the groups (`strata:pipeline_groups`), so a stage's idle time can be read against what
   the mode allows: the bubble is 1 - (sum of the stages' busy fractions) / groups.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pool.endpoints import LOOPBACK_HOSTS, WILDCARD_HOSTS, tcp_host_port

SPIN_TURNS = "10000"  # rule 5


def machine(endpoint: str) -> str:
    """Which machine an endpoint's stage runs on, as far as the config says: "local" or the tcp host."""
    hp = tcp_host_port(endpoint)
    if hp is None or hp[0] in LOOPBACK_HOSTS or hp[0] in WILDCARD_HOSTS:
        return "local"  # ipc:// is this machine's, and so is a loopback or wildcard tcp host
    return hp[0]


def turns(cfg: Any) -> bool:
    """Rule 1: the stages take turns (one step in flight) on this box."""
    mode, stages = cfg.engine.pipeline, cfg.stages
    if mode != "auto":
        return not mode and len(stages) > 1
    return (len(stages) > 1 and all(s.device == "cpu" for s in stages)
            and len({machine(s.endpoint) for s in stages}) == 1)


def groups(cfg: Any) -> int:
    """Rule 2: steps in flight (before chained ones) and groups of decoding slots."""
    return 1 if turns(cfg) else len(cfg.stages)


def sharing(cfg: Any, index: int) -> int:
    """Rule 3: how many CPU stages split the cores of stage `index`'s machine (1 in turns)."""
    if turns(cfg):
        return 1
    here = machine(cfg.stages[index].endpoint)
    return sum(1 for s in cfg.stages if s.device == "cpu" and machine(s.endpoint) == here)


def spin_env(cfg: Any, index: int, environ: Mapping[str, str]) -> dict[str, str]:
    """Rule 5: what stage `index` adds to its environment before torch loads OpenMP."""
    if (not turns(cfg) or cfg.stages[index].device != "cpu"
            or "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ):
        return {}
    return {"GOMP_SPINCOUNT": SPIN_TURNS}
