"""Stage runners in-process with the scheduler's part played by a `Local`: one authoritative map, its ops (and
their generations, as the link sends them) applied to every runner before each step, greedy chains per slot.

`make_cfg(model_dir, ranges, pool=True, **engine)` builds the config of a CPU box over `ranges`;
`Local(cfg, tmp)` starts its runners (pool files under `tmp`); the `local` fixture of tests/stages/conftest.py
makes them and closes them after the test.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from pool.chunk_map import ChunkMap, StaticMap
from pool.config import Config, config_from_dict
from stages.runner import StageRunner

GREEDY = {"temperature": 0.0}
PROMPT_A = [5, 17, 99, 3, 250, 41, 8, 77, 120, 6, 33, 2, 9, 64, 18, 200, 11]  # 17 tokens: two chunks of 16
PROMPT_B = [301, 7, 45, 12, 88]


def make_cfg(model_dir: Path, ranges: list[list[int]], pool: bool = True, **engine: object) -> Config:
    stages = [{"device": "cpu", "layers": r, "endpoint": f"ipc:///tmp/strata-test-runner-{i}"}
              for i, r in enumerate(ranges)]
    eng = {"max_context": 64, "parallel": 4, "chunk_cells": 16, "prefill_chunk": 64, "threads": 1,
           "kv_pool_tokens": 192 if pool else 0, **engine}
    return config_from_dict({"model": str(model_dir), "engine": eng, "stages": stages})


class Local:
    """The scheduler's part in-process: one map, ops applied to every runner before each step."""

    def __init__(self, cfg: Config, tmp: Path, tag: str = "") -> None:
        e = cfg.engine
        self.map = (ChunkMap if e.pool_on else StaticMap)(e.n_chunks, e.chunk_cells, e.table_chunks, e.parallel)
        self.runners = [StageRunner(cfg, i, pool_path=tmp / f"pool{tag}{i}") for i in range(len(cfg.stages))]
        self.step_id = 0

    def sync(self) -> None:
        """Send the map's ops to every runner, then the generations of the chunks they gave (as OPS do)."""
        ops = self.map.drain_ops()
        generations = self.map.generations_of(ops)
        for r in self.runners:
            for op in ops:
                r.apply(op)
            r.record_generations(generations)

    def step(self, slots: list[list[int]], tokens: list[int], sampling: dict | None = None, **extra: object) -> list:
        for slot, start, n, _ in slots:
            assert self.map.reserve(slot, start + n)
        self.sync()
        self.step_id += 1
        header = {"step": self.step_id, "version": self.map.version, "slots": slots, "sampling": sampling or {},
                  **extra}
        ids = torch.tensor(tokens, dtype=torch.int32)
        x = None
        for r in self.runners:
            x = r.step(header, ids, x)
        return x

    def decode(self, slot: int, pos: int, token: int, n: int, sampling: dict | None = None) -> list[int]:
        out = [token]
        for i in range(n):
            res = self.step([[slot, pos + i, 1, 1]], [out[-1]], sampling if i == 0 else None)
            out.append(res[0][1])
        return out[1:]

    def generate(self, slot: int, prompt: list[int], n: int) -> list[int]:
        first = self.step([[slot, 0, len(prompt), 1]], prompt, {slot: dict(GREEDY)})[0][1]
        return [first, *self.decode(slot, len(prompt), first, n)]

    def close(self, unlink: bool = True) -> None:
        for r in self.runners:
            r.close(unlink=unlink)


def use_wrong_source(module: ModuleType, edit: tuple[str, str], tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Point a CPU library module (stages/cpu_ops.py, stages/decode_layer.py, ...) at its source with `edit`
    applied, built into a fresh kernel cache: its first-use check then decides on the wrong library. The caller
    clears the module's `_library` cache before and after (a `fresh_library` fixture)."""
    source = module.SOURCE.read_text()
    wrong = source.replace(*edit)
    assert wrong != source, f"{edit[0]!r} is not in {module.SOURCE.name}"
    bad = tmp_path / "bad.c"
    bad.write_text(wrong)
    monkeypatch.setattr(module, "SOURCE", bad)
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "kernels"))


def gguf_blocks(kind: str, n: int, k: int, seed: int = 0):
    """The raw blocks of a [n, k] GGUF tensor of type `kind`: gguf's quantizer on seeded normal values where it has
    one, else random bytes with sane f16 scales (the k-quants)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[kind]
    if not kind.endswith("_K"):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), t)
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    if kind == "Q6_K":  # ql, qh, int8 scales, then d
        raw[:, 208:210] = rng.uniform(1e-3, 2e-2, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    else:
        raw[:, 0:4] = rng.uniform(1e-3, 2e-2, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)  # d, dmin
    return raw.reshape(n, -1)
