"""One stage's compute state: its layers, its share of the KV pool, its table mirror, its sampler.

The server (stages/server.py) owns the sockets and calls a StageRunner from one compute thread, in the
order the coordinator sent things: `apply(op)` for each table op, `step(header, tokens, hidden)` for each
step, `load_snapshot(ops)` when the stage (re)joins, `reset()` for a new coordinator session.

Rules:
- A step (and a session file's SAVE or LOAD) runs only when its table `version` equals the mirror's
  version. Ops always reach a stage before the steps that depend on them, on one ordered stream, so any difference means an op was lost or
  reordered: the step is refused with StaleStep and nothing is written, so no step ever runs against
  a stale table.
- Ops change the mirror first (it refuses gaps), then the changed slot rows are copied into the KV
  cache's fixed-address tables in place; an "exchange" op (the pool-off baseline moving a conversation)
  swaps the bytes of the two tables' fixed regions.
- The pool share is one file (pool/memory.py) on every device; arrays are `torch.frombuffer` views of it, so
  a restarted stage re-attaches the same bytes. A file left by a crash is re-attached when its layout
  matches, replaced otherwise. A clean `close()` removes the file. On CUDA the file is pinned
  (cudaHostRegister) and steps read it through a device window of frames (stages/window.py), sized by
  `engine.device_cells` (pool/window_plan.py); a CPU stage runs the same window when `device_cells` is set.
- Generations: OPS carry the generation of every chunk they give to a table (`ChunkMap.generations_of`); the
  runner writes them into the pool file's header after the ops' bytes moved, and HELLO reports them, so after
  a crash the coordinator keeps exactly the conversations whose chunks this file still holds for them. They
  belong to one coordinator session: `reset(session)` zeroes them when the file names another session.
- Chained rows (pool/step_chain.py): a step whose header has `chain` runs only with `engine.chain_steps`, and
  on a first stage that samples or takes the last stage's samples (the ring, recorded by stages/compute.py);
  each chained row reads the token sampled for its slot in the step it names, else the step is refused before
  anything runs.
- Session files (stages/snapshot.py): `save_session` writes cells [0, cells) of a table to this stage's part,
  `restore_session` checks a part (`check`) or reads it into a table's cells; with linear-attention layers the
  request names the table's state entry (`state`), saved and read with the cells. Names are joined to this
  stage's own `engine.slot_save_path`, never taken as paths.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from pool.chunk_map import TableMirror, region
from pool.config import Config, ConfigError
from pool.memory import PoolLayout, PoolMemory, PoolMismatch, default_path
from pool.runtime import Hold, hold, private_dir
from pool.snapshot import SnapshotError, check_save_id, other_parts, part_path, snapshot_fingerprint
from pool import pipeline, step_chain
from pool.step_chain import Samples
from pool.window_plan import Geometry, frame_bytes, plan_frames, scratch_bytes
from pool.wire import PROTOCOL

from . import cpu_attention, cpu_ops, decode_layer, packed_linear
from .batch import StepBatch
from .checkpoint import load_checkpoint
from .kv_cache import KVCache, kv_dtype_name
from .model import StageModel, resolve_dtype
from .snapshot import arrays_of, check_part, load_part, save_part
from .state_pool import StatePool
from .tensors import pool_array
from .window import DeviceWindow


class StaleStep(RuntimeError):
    """A step whose table version is not the one this stage has reached; it was not run."""


def resolve_model_dir(model: str) -> Path:
    """The checkpoint directory (or .gguf file) of `model`: "tiny" (or "tiny:key=value,...") is built once into the
    cache."""
    if model == "tiny" or model.startswith("tiny:"):
        from .tiny import ensure_tiny

        return ensure_tiny(model)
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    if not (path / "config.json").is_file():
        raise ConfigError(f"model: {model} is not a checkpoint directory (no config.json)", key="model")
    return path


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def stage_threads(cfg: Config, index: int) -> int:
    """Torch CPU threads for stage `index`; 0 leaves torch's default.

    `engine.threads` when set. Otherwise a CPU stage gets this machine's cores: all of them when the stages take
    turns (pool/pipeline.py rule 3), else shared evenly among the CPU stages the config puts on the same
    machine (at least one each), since two pipelined stages that each run a thread per core spin against each
    other, which makes a step several times slower (docs/BENCHMARKS.md). A GPU stage keeps torch's default (its
    CPU threads only launch work).
    """
    if cfg.engine.threads:
        return cfg.engine.threads
    stage = cfg.stages[index]
    if stage.device != "cpu":
        return 0
    return max(1, _cores() // pipeline.sharing(cfg, index))


class StageRunner:
    """Layers `cfg.stages[index].layers` with their KV pool share; see the module docstring for the rules."""

    def __init__(self, cfg: Config, index: int, pool_path: str | Path | None = None) -> None:
        stage, e = cfg.stages[index], cfg.engine
        self.cfg, self.index = cfg, index
        self.first, self.last = stage.layers
        self.device = torch.device(stage.device)
        threads = stage_threads(cfg, index)
        if threads:
            torch.set_num_threads(threads)  # from the compute thread, which runs every op of the stage
        self.ckpt = load_checkpoint(resolve_model_dir(cfg.model))
        n_layers = self.ckpt.num_layers
        if self.last > n_layers:
            raise ConfigError(
                f"stages.{index}.layers=[{self.first}, {self.last}) but the model has {n_layers} layers",
                key=f"stages.{index}.layers",
            )
        self.dtype = resolve_dtype(e.dtype, self.ckpt, [s.device.split(":")[0] for s in cfg.stages])
        self.model = StageModel(self.ckpt, self.first, self.last, self.device, self.dtype,
                                int8_activations=e.int8_activations)
        self.model_fp = self.ckpt.fingerprint()[:16]
        self.config_fp = cfg.fingerprint()
        self.kv_dtype = "int8" if e.kv_dtype == "int8" else kv_dtype_name(self.dtype)
        self.n_slots, self.table_chunks = e.parallel, e.table_chunks
        layout = PoolLayout(self.model.num_kv_layers, e.n_chunks, e.chunk_cells, self.model.kv_heads,
                            self.model.head_dim, self.kv_dtype)
        # The pool file is the K/V's home on every device: mapped here, pinned on CUDA, re-attached after a crash.
        path = Path(pool_path) if pool_path else default_path(f"{self.config_fp}-stage{index}")
        self.memory, self.reattached, self._pool_lock = _open_pool(path, layout)
        self.pinned = self.device.type == "cuda" and self.memory.pin(self.device.index)

        def storage(layer: int, which: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            return pool_array(self.memory, layer, which)

        self.kv = KVCache(layout.n_layers, e.n_chunks, e.chunk_cells, self.model.kv_heads, self.model.head_dim,
                          self.kv_dtype, "cpu", self.n_slots, self.table_chunks, storage=storage)
        self.window = self._window(layout)
        if self.model.cpu_ops:  # a float32 CPU stage: float32 queries over a float32 or int8 pool
            cpu_attention.available()  # compiled and checked at load, not in the first step (its rules 4-5)
            cpu_ops.available()  # the same for the layer ops (its rule 4)
            decode_layer.log_layers(self.model.decode_layers())  # and the one call per decode layer
        if self.device.type == "cpu":
            packed = self.model.packed_weights()
            packed_linear.tune(packed)  # its rule 6: how few rows run padded, on this CPU
            packed_linear.huge_resident(packed)  # its rule 8, read back and logged
        # Linear-attention layers (stages/state_pool.py): entries the step header names per row (`states`; the
        # coordinator's coordinator/linear_state.py), by default the slot's own.
        self.state = self.model.new_state_pool(e.n_state_entries + e.n_state_checkpoints,
                                               path.with_name(path.name + ".state"))
        self.mirror = TableMirror(e.n_chunks, self.table_chunks, self.n_slots)
        self.sampler = None
        self.samples = Samples()  # each slot's last sampled token, for chained steps (pool/step_chain.py)
        if self.model.is_last:
            from .sampling import Sampler

            self.sampler = Sampler(self.n_slots, self.model.vocab_size, self.device)
        self.max_context = e.max_context

    def _window(self, layout: PoolLayout) -> DeviceWindow | None:
        """The device window over the pool (stages/window.py), sized by pool/window_plan.py; None when off."""
        e, spec = self.cfg.engine, self.model.spec
        if not layout.n_layers:
            return None  # linear-attention layers only: no K/V to window
        frame = frame_bytes(e.chunk_cells, layout.bytes_per_cell, layout.n_layers)
        free = weights = None
        scratch = 0
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            weights = torch.cuda.memory_allocated(self.device)
            scratch = scratch_bytes(e, Geometry(spec.hidden_size, spec.intermediate_size, spec.num_heads,
                                                spec.kv_heads, spec.head_dim, spec.vocab_size, self.model.is_last))
        n_frames = plan_frames(e, self.device.type, frame, self.index, free, weights, scratch)
        if not n_frames:
            return None
        return DeviceWindow(self.kv, n_frames, self.device, self.memory.generations, self.model.sliding_windows,
                            spec.num_heads)

    def window_stats(self) -> dict | None:
        """The window's size and counters (stages/window.py rule 7), None without a window."""
        return self.window.describe() if self.window is not None else None

    # ---- handshake and tables ------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.mirror.version

    def hello(self) -> dict:
        """What the coordinator checks before serving: coverage, checkpoint, config, pool geometry."""
        e = self.cfg.engine
        return {
            "protocol": PROTOCOL,
            "stage": self.index,
            "layers": [self.first, self.last],
            "model_layers": self.ckpt.num_layers,
            "model_fp": self.model_fp,
            "config_fp": self.config_fp,
            "pool": {"n_chunks": e.n_chunks, "chunk_cells": e.chunk_cells, "table_chunks": self.table_chunks,
                     "kv_dtype": self.kv_dtype, "n_slots": self.n_slots,
                     "file": str(self.memory.path), "reattached": self.reattached,
                     "pinned": self.pinned, "window": self.window_stats()},
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "pid": os.getpid(),
            "version": self.mirror.version,
            "vocab": self.model.vocab_size,  # logits per sampled row: the size of a grammar mask
            "state_entries": e.n_state_entries if self.state is not None else 0,  # coordinator/linear_state.py
            "state_checkpoints": e.n_state_checkpoints if self.state is not None else 0,  # state_checkpoints.py
            # tokens each entry holds, when they outlive the process (stages/state_pool.py rule 5)
            "state_held": self.state.held() if self.state is not None and self.state.file is not None else None,
            "weight_bytes": self.model.weight_bytes(),  # as loaded (GGUF weights kept quantized: packed)
            "generations": list(self.memory.generations[: e.n_chunks]),
        }

    def describe(self) -> str:
        pool = f"pool file {self.memory.path}{' (pinned)' if self.pinned else ''}"
        if self.window is not None:
            pool += f", device window {self.window.n_frames} frames = {self.window.cells} cells"
        compute = f"{torch.get_num_threads()} threads, " if self.device.type == "cpu" else ""
        compute += "in turns" if pipeline.turns(self.cfg) else "pipelined" if len(self.cfg.stages) > 1 else "one stage"
        return (f"layers [{self.first}, {self.last}) of {self.ckpt.num_layers} on {self.device} "
                f"({str(self.dtype).removeprefix('torch.')}, kv {self.kv_dtype}, {self.cfg.engine.n_chunks} chunks, "
                f"{pool}; {compute})")

    def apply(self, op: list) -> None:
        """Apply one table op: the mirror (which refuses gaps), then device rows, then byte exchanges."""
        self.mirror.apply(op)
        if op[0] == "exchange":
            _, _, a, b, cells = op
            self.kv.exchange(region(a, self.table_chunks), region(b, self.table_chunks), cells)
        for slot in sorted(self.mirror.changed_slots):
            self.kv.set_table(slot, self.mirror.entries(slot))

    def load_snapshot(self, ops: list) -> None:
        """Replace every table with a snapshot (`snapshot_ops()`), e.g. when this stage rejoins."""
        self.mirror.load(ops)
        for slot in range(self.n_slots):
            self.kv.set_table(slot, self.mirror.entries(slot))

    def reset(self, session: str | None = None) -> None:
        """Empty tables at version 0 (a new coordinator session); the K/V bytes stay where they are.

        With `session`: the pool file's generations are zeroed unless they already belong to that session
        (a restarted stage rejoining the coordinator that sent them keeps them for it to compare)."""
        self.mirror = TableMirror(self.cfg.engine.n_chunks, self.table_chunks, self.n_slots)
        self.kv.clear_tables()
        self.samples.clear()
        if self.state is not None and (session is None or self.state.session != session):
            self.state.forget()  # a state file of the same session keeps its entries (stages/state_pool.py rule 5)
            if session is not None:
                self.state.session = session
        if session is not None and self.memory.session != session:
            if self.window is not None:
                self.window.clear()  # generations restart with the new session (stages/window.py rule 2)
            gens = self.memory.generations
            for c in range(len(gens)):
                gens[c] = 0
            self.memory.session = session

    def record_generations(self, pairs: list) -> None:
        """Note [[chunk, generation], ...] from an OPS message in the pool file."""
        gens = self.memory.generations
        for chunk, generation in pairs:
            if not 0 <= chunk < len(gens):
                raise ValueError(f"generation for chunk {chunk}, outside 0..{len(gens) - 1}")
            gens[chunk] = generation

    # ---- session files -------------------------------------------------------------------------------
    def _part(self, req: dict) -> tuple[Path, int, dict]:
        """(path, cells, header fields both sides agree on) of the part a SAVE or LOAD names."""
        directory = self.cfg.engine.slot_save_path
        if not directory:
            raise SnapshotError("session files are disabled on this stage (engine.slot_save_path is not set)")
        cells = req["cells"]
        if not 0 < cells <= self.max_context:
            raise SnapshotError(f"{cells} cells: a session file holds 1..max_context={self.max_context} cells")
        e = self.cfg.engine
        fields = {"save_id": req["save_id"], "model_fp": self.model_fp, "n_stages": len(self.cfg.stages),
                  "config_fp": snapshot_fingerprint(e.dtype, e.kv_dtype, [s.layers for s in self.cfg.stages]),
                  "kv_dtype": self.kv_dtype, "stage": self.index, "layers": [self.first, self.last],
                  "kv_heads": self.model.kv_heads, "head_dim": self.model.head_dim, "arrays": arrays_of(self.kv)}
        if self.state is not None:  # the table's state entry travels with its cells (stages/snapshot.py)
            fields["state"] = {"linear_layers": self.state.n_layers, "entry_nbytes": self.state.entry_nbytes}
        return part_path(directory, req["name"], self.index, req["save_id"]), cells, fields

    def _state_of(self, req: dict) -> tuple[StatePool, int] | None:
        """(state pool, entry) a SAVE or LOAD of a table names on a stage with linear-attention layers."""
        if self.state is None:
            return None
        e = req.get("state")
        if not isinstance(e, int) or not 0 <= e < self.state.n_entries:
            raise SnapshotError(f"this stage keeps linear-attention state: the request must name the table's "
                                f"state entry (0..{self.state.n_entries - 1}), got {e!r}")
        return self.state, e

    def _check_version(self, req: dict) -> None:
        if req.get("version") != self.mirror.version:
            raise StaleStep(f"{req.get('name')}: needs table version {req.get('version')} but this stage has "
                            f"applied ops up to version {self.mirror.version}")

    def save_session(self, req: dict) -> int:
        """SAVE {name, save_id, version, table, cells}: write this stage's part of that save; returns its bytes.
        SAVE {name, save_id, tidy: "others" | "this"} removes this stage's parts of the other saves of that name
        (after the switch) or of this one (a save that failed elsewhere); returns 0 (pool/snapshot.py rules)."""
        tidy = req.get("tidy")
        if tidy is not None:
            directory, name, save_id = self.cfg.engine.slot_save_path, req["name"], check_save_id(req["save_id"])
            if not directory:
                raise SnapshotError("session files are disabled on this stage (engine.slot_save_path is not set)")
            if tidy == "others":
                doomed = other_parts(directory, name, self.index, keep=save_id)
            else:
                doomed = [part_path(directory, name, self.index, save_id)]
            for path in doomed:
                path.unlink(missing_ok=True)
            return 0
        path, cells, fields = self._part(req)
        self._check_version(req)
        return save_part(self.kv, self.mirror.entries(req["table"]), cells, path, fields, self._state_of(req))

    def restore_session(self, req: dict) -> int:
        """LOAD {name, save_id, cells, check} checks this stage's part; LOAD {..., version, table} (no check)
        also reads it into the table's cells. Returns the part's bytes."""
        path, cells, fields = self._part(req)
        if req.get("check"):  # sizes only: no entry is read or written
            return check_part(self.kv, path, cells, fields, None if self.state is None else (self.state, 0))
        self._check_version(req)
        return load_part(self.kv, self.mirror.entries(req["table"]), cells, path, fields, self._state_of(req))

    # ---- steps ---------------------------------------------------------------------------------------
    def check_step(self, header: dict) -> None:
        """Raise StaleStep unless the step's table version is the mirror's; ValueError for a bad slot entry,
        SharedWrite (a ValueError) for one that would write into a chunk another table holds."""
        sid, version = header.get("step"), header.get("version")
        if version != self.mirror.version:
            raise StaleStep(
                f"step {sid} needs table version {version} but this stage has applied ops up to version "
                f"{self.mirror.version}: an op was lost or reordered, the step was not run"
            )
        for slot, start, n, _ in header["slots"]:
            if not 0 <= slot < self.n_slots:
                raise ValueError(f"step {sid}: slot {slot} does not exist (parallel={self.n_slots})")
            if start + n > self.max_context:
                raise ValueError(f"step {sid}: slot {slot} reaches cell {start + n}, max_context is {self.max_context}")
            self.mirror.check_write(slot, start, n, self.cfg.engine.chunk_cells, step=sid)  # SharedWrite
        if header.get("chain") and not (step_chain.enabled(self.cfg)
                                        and (self.model.is_last or step_chain.ring(self.cfg))):
            raise ValueError(f"step {sid}: chained rows need engine.chain_steps and a first stage that samples or "
                             f"hears the last stage's samples (pool/step_chain.py rule 1); this one holds layers "
                             f"{self.first}-{self.last}")

    def step(self, header: dict, tokens: torch.Tensor | None, hidden: torch.Tensor | None) -> Any:
        """Run one step: hidden `[T, hidden]` on a non-last stage, RESULT token rows on the last.

        `tokens` (int32 `[T]`) is read by the first stage, `hidden` by the others. The last stage returns
        `[[slot, token, logprob, [[id, logprob], ...]], ...]` for the slots with sample=1, in header order.
        """
        self.check_step(header)
        sid, slots = header.get("step"), header["slots"]
        x = tokens if self.model.is_first else hidden
        if x is None:
            raise ValueError(f"step {sid}: no {'token ids' if self.model.is_first else 'hidden states'} came with it")
        if header.get("chain") and self.model.is_first:  # tokens sampled in the steps before (pool/step_chain.py)
            self.samples.fill(sid, slots, header["chain"], x)
        if self.sampler is not None:
            for slot, params in (header.get("sampling") or {}).items():
                params = dict(params)
                history = params.pop("history", None) or []
                self.sampler.reset(int(slot), params, list(history))
        batch = StepBatch.from_slots(slots, self.device, state_entries=header.get("states"))
        keep = header.get("keep") or []
        if any(not 0 <= int(row) < len(slots) for row, _ in keep):
            raise ValueError(f"step {sid}: keep {keep} names a row outside its {len(slots)} slots")
        keeps = [[batch.state_entries[int(row)], dst] for row, dst in keep]
        if self.state is not None:  # state checkpoints (stages/state_pool.py rule 4)
            self.state.check_copies(keeps + list(header.get("restore") or []))
            for src, dst in header.get("restore") or []:
                self.state.copy(int(src), int(dst))
        if self.window is None:
            out = self.model.forward(batch, self.kv, x, state=self.state)
        else:
            with self.window.step(batch) as view:
                out = self.model.forward(batch, view, x, state=self.state)
        if self.state is not None:
            for src, dst in keeps:
                self.state.copy(int(src), int(dst))
        if self.sampler is None:
            return out
        rows = batch.sample_slots
        if not rows:  # a step of prompt pieces only: nothing to sample yet
            if header.get("masks"):
                raise ValueError(f"step {sid}: grammar masks for slots {sorted(header['masks'])}, which sample nothing")
            return []
        sampled = self.sampler.sample(out, rows, header.get("masks"))
        result = [[slot, int(tok), float(lp), [[int(i), float(p)] for i, p in (top or [])]]
                  for slot, (tok, lp, top) in zip(rows, sampled)]
        self.samples.record(sid, result)
        return result

    def close(self, unlink: bool = True) -> None:
        """Drop the arrays and the mapping; `unlink` also removes the pool file (a clean shutdown)."""
        if self.state is not None and self.state.file is not None:
            state = self.state.file
            self.state.close()
            if unlink:
                state.unlink()
        self.kv = self.window = self.state = None  # type: ignore[assignment]
        if self.memory is not None:
            self.memory.close()
            if unlink:
                self.memory.unlink()
            self.memory = None
            self._pool_lock.release()


def _open_pool(path: Path, layout: PoolLayout) -> tuple[PoolMemory, bool, Hold]:
    """Lock the pool file (`<path>.lock`: InUse while a live stage has it), then re-attach the file a crashed stage
    left when its layout matches, otherwise make a fresh one. A file that is not private (another user's, not
    0600, a symlink) is refused, never replaced."""
    private_dir(path.parent)
    lock = hold(path.with_name(path.name + ".lock"), f"pool file {path}")
    try:
        if os.path.lexists(path):
            try:
                return PoolMemory.attach(path, layout), True, lock
            except PoolMismatch:
                pass
        return PoolMemory.create(path, layout), False, lock
    except BaseException:
        lock.release()
        raise
