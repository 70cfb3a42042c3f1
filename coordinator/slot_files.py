"""Session files, the coordinator's side: llama.cpp's `POST /slots/{id}?action=save|restore`.

The coordinator writes and reads the tokens part (`<slot_save_path>/<name>`); each stage its own K/V part
(`<name>.stage<i>`), asked with SAVE / LOAD on the ordered stream (pool/snapshot.py has the format).

Save (an idle slot holding a conversation), all or nothing (pool/snapshot.py rules):
  1. pin the slot (no admission uses it), send pending ops, then SAVE {name, save_id, version, table, cells} to
     every stage: each stage writes the cells the steps before it wrote, read through the slot's table, to its
     part of this save (`<name>.<save_id>.stage<i>`), beside the previous save's parts;
  2. when every stage has answered ok, write the tokens part, which names the save id: the switch. Then every
     stage removes its parts of other saves of that name (SAVE {tidy: "others"}).
  If a stage or the tokens part fails, the stages remove this save's parts (SAVE {tidy: "this"}) and the
  previous snapshot of that name is still whole. A full disk (ENOSPC, EDQUOT, EFBIG) is a 507
  `insufficient_storage`; other write errors a 500.
Restore (an idle slot):
  1. read and check the tokens part (model, config, kv dtype, number of stages, hash): a refusal is a 400 and
     changes nothing;
  2. LOAD {check} to every stage: each reads its whole part (header, geometry, size, hash) and writes nothing;
     a refusal is a 400 naming the stage and why, and changes nothing;
  3. reserve the cells in a new table (the usual eviction plan first; 503 kv_pool_full if it cannot), send the
     ops, LOAD {version, table}: each stage reads its part into the new table's chunks;
  4. commit: the new table moves into the slot (a swap, no copy with the pool on) and the slot's previous
     conversation, if any, is parked. If step 3 fails the new table is released: free cells are as before.
A model with linear-attention layers: each stage's part also holds the table's state entry (stages/snapshot.py);
a save names the slot's entry, a restore gives the new table an entry first (a free one, else the least recently
used parked conversation's) and each stage reads the state into it.
Errors: no `engine.slot_save_path` 501 `not_supported`; a bad filename or slot 400; a busy slot 409 `slot_busy`;
a stage down 503 `stage_down`.
"""
from __future__ import annotations

import errno
import logging
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from pool.logs import event
from pool.snapshot import (SnapshotError, check_name, check_save_id, part_path, read_tokens, snapshot_fingerprint,
                           write_tokens)
from pool.wire import LOAD, SAVE

from .conversations import Conversation
from .engine import EngineError
from .link import StageDown

if TYPE_CHECKING:
    from .scheduler import Scheduler

log = logging.getLogger("strata.coord")


def _directory(sched: Scheduler) -> Path:
    directory = sched.cfg.engine.slot_save_path
    if not directory:
        raise EngineError(501, "not_supported", "slot save/restore is disabled: start the server with "
                          "engine.slot_save_path set to a directory", type="invalid_request_error")
    return Path(directory)


def _name(filename: object) -> str:
    try:
        return check_name(filename)
    except SnapshotError as err:
        raise EngineError.invalid(str(err), param="filename") from None


def _fields(sched: Scheduler) -> dict:
    """What every part of a save records and a restore must find: model, config, kv dtype, stages."""
    hello = sched.link.stage_hello(0) or {}
    e = sched.cfg.engine
    return {"model_fp": hello.get("model_fp"), "n_stages": len(sched.cfg.stages),
            "config_fp": snapshot_fingerprint(e.dtype, e.kv_dtype, [s.layers for s in sched.cfg.stages]),
            "kv_dtype": hello.get("pool", {}).get("kv_dtype")}


STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _storage(message: str, code: int | None) -> EngineError:
    """507 `insufficient_storage` for a full disk or a file size limit; 500 for any other write error."""
    if code in STORAGE_ERRNOS:
        return EngineError(507, "insufficient_storage", f"{message}; the previous snapshot of that name is kept",
                           type="server_error")
    return EngineError.internal(message)


async def _ask(sched: Scheduler, kind: str, header: dict) -> list[dict]:
    """Every stage's DONE for `header`; the first failure as an EngineError."""
    try:
        answers = await sched.link.ask(kind, [header] * len(sched.cfg.stages))
    except StageDown as err:
        raise EngineError.stage_down(str(err), retry_after=sched.cfg.coordinator.retry_after_s) from None
    for a in answers:
        if not a.get("ok"):
            message = f"stage {a.get('stage')}: {a.get('message')}"
            if a.get("refused"):
                raise EngineError.invalid(message, param="filename")
            raise _storage(message, a.get("errno"))
    return answers


async def _tidy(sched: Scheduler, name: str, save_id: str, which: str) -> None:
    """Ask every stage to remove its parts of other saves (`which="others"`) or of this one; a failure is only
    logged: leftover parts cost disk, never correctness (a manifest names exactly one save)."""
    try:
        await _ask(sched, SAVE, {"name": name, "save_id": save_id, "tidy": which})
    except EngineError as err:
        event(log, "session_file.tidy_failed", logging.WARNING, file=name, which=which, message=err.message)


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 3)


async def save_slot(sched: Scheduler, slot: int, filename: object) -> dict:
    """Save the conversation idle slot `slot` holds; llama.cpp's answer shape plus nothing."""
    directory, name = _directory(sched), _name(filename)
    sched.check_idle(slot)
    conv = sched.held.get(slot)
    if conv is None or not conv.tokens:
        raise EngineError.invalid(f"slot {slot} holds no conversation to save", param="id")
    tokens, save_id, t0 = list(conv.tokens), uuid.uuid4().hex, time.perf_counter()
    sched.pinned.add(slot)
    try:
        sched.send_ops()
        try:
            req = {"name": name, "save_id": save_id, "version": sched.map.version, "table": slot,
                   "cells": len(tokens)}
            if sched.keeps_state():  # the slot's state entry is saved with its cells (linear_state.py)
                req["state"] = sched.cache.entries.of[slot]
            answers = await _ask(sched, SAVE, req)
            try:
                nbytes = write_tokens(part_path(directory, name), {**_fields(sched), "save_id": save_id}, tokens)
            except OSError as err:
                raise _storage(f"{name}: {os.strerror(err.errno) if err.errno else err}", err.errno) from None
        except EngineError as err:
            if err.code != "stage_down":
                await _tidy(sched, name, save_id, "this")
            raise
        await _tidy(sched, name, save_id, "others")
    finally:
        sched.pinned.discard(slot)
        sched._wake.set()
    return {"id_slot": slot, "filename": name, "n_saved": len(tokens),
            "n_written": nbytes + sum(a["nbytes"] for a in answers), "timings": {"save_ms": _ms(t0)}}


async def restore_slot(sched: Scheduler, slot: int, filename: object) -> dict:
    """Restore a saved conversation into idle slot `slot`; its previous conversation is parked."""
    directory, name = _directory(sched), _name(filename)
    sched.check_idle(slot)
    t0 = time.perf_counter()
    try:
        header, tokens, nbytes = read_tokens(part_path(directory, name), **_fields(sched))
    except SnapshotError as err:
        raise EngineError.invalid(str(err), param="filename") from None
    n = len(tokens)
    try:
        check_save_id(header["save_id"])
    except SnapshotError as err:
        raise EngineError.invalid(f"{name}: {err}", param="filename") from None
    if not 0 < n <= sched.max_context:
        raise EngineError.invalid(f"{name} holds {n} tokens; this server's max_context is {sched.max_context}",
                                  param="filename")
    req = {"name": name, "save_id": header["save_id"], "cells": n}
    sched.pinned.add(slot)
    table = None
    try:
        await _ask(sched, LOAD, {**req, "check": True})
        table = sched.cache.park_table()
        if table is None or not sched.cache.reserve(table, n):
            raise EngineError.kv_pool_full(n, sched.map.free_cells, sched.cfg.coordinator.retry_after_s)
        load = {**req, "table": table}
        if sched.keeps_state():
            if not sched.cache.entry_for_table(table):
                raise EngineError(503, "kv_pool_full", f"no linear-attention state entry is free for the restore: "
                                  f"all {sched.cache.entries.n_entries} are held by slots (engine.state_entries); "
                                  f"retry in {sched.cfg.coordinator.retry_after_s} s",
                                  retry_after=sched.cfg.coordinator.retry_after_s)
            load["state"] = sched.cache.entries.of[table]
        sched.send_ops()
        answers = await _ask(sched, LOAD, {**load, "version": sched.map.version})
        conv = Conversation(table, tokens)
        sched.held[table] = conv
        table = None
        sched.cache.bring(conv, slot)  # the slot's previous conversation is parked in its place
    finally:
        if table is not None:
            sched.cache.release(table)
        sched.pinned.discard(slot)
        sched._wake.set()
    return {"id_slot": slot, "filename": name, "n_restored": n,
            "n_read": nbytes + sum(a["nbytes"] for a in answers), "timings": {"restore_ms": _ms(t0)}}
