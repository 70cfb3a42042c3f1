"""StageRunner in-process: handshake fields, ops into fixed-address tables, refusal of stale steps, the pool
file as the K/V's home (re-attached after a crash), moves by swap and by byte exchange, and a split that
gives the same tokens as one stage."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from pool.chunk_map import ChunkMap, OpGap, StaticMap
from pool.config import Config, ConfigError, config_from_dict
from pool.memory import PoolMemory
from pool.wire import PROTOCOL
from stages.checkpoint import load_checkpoint
from stages.runner import StageRunner, StaleStep
from stages.tensors import pool_array

GREEDY = {"temperature": 0.0}
PROMPT_A = [5, 17, 99, 3, 250, 41, 8, 77, 120, 6, 33, 2, 9, 64, 18, 200, 11]  # 17 tokens: two chunks of 16
PROMPT_B = [301, 7, 45, 12, 88]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen3", layers=4, hidden=64, heads=4, kv_heads=2, seed=3)


def make_cfg(model_dir: Path, ranges: list[list[int]], pool: bool = True, **engine: object) -> Config:
    stages = [{"device": "cpu", "layers": r, "endpoint": f"ipc:///tmp/strata-test-runner-{i}"}
              for i, r in enumerate(ranges)]
    eng = {"max_context": 64, "parallel": 4, "chunk_cells": 16, "prefill_chunk": 64, "threads": 1,
           "kv_pool_tokens": 192 if pool else 0, **engine}
    return config_from_dict({"model": str(model_dir), "engine": eng, "stages": stages})


class Local:
    """The scheduler's part in-process: one map, ops applied to every runner before each step."""

    def __init__(self, cfg: Config, tmp: Path) -> None:
        e = cfg.engine
        self.map = (ChunkMap if e.pool_on else StaticMap)(e.n_chunks, e.chunk_cells, e.table_chunks, e.parallel)
        self.runners = [StageRunner(cfg, i, pool_path=tmp / f"pool{i}") for i in range(len(cfg.stages))]
        self.step_id = 0

    def sync(self) -> None:
        for op in self.map.drain_ops():
            for r in self.runners:
                r.apply(op)

    def step(self, slots: list[list[int]], tokens: list[int], sampling: dict | None = None) -> list:
        for slot, start, n, _ in slots:
            assert self.map.reserve(slot, start + n)
        self.sync()
        self.step_id += 1
        header = {"step": self.step_id, "version": self.map.version, "slots": slots, "sampling": sampling or {}}
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


@pytest.fixture
def local(model_dir, tmp_path):
    made: list[Local] = []

    def make(ranges: list[list[int]], pool: bool = True, **engine: object) -> Local:
        made.append(Local(make_cfg(model_dir, ranges, pool, **engine), tmp_path))
        return made[-1]

    yield make
    for m in made:
        m.close()


def test_hello_reports_what_the_coordinator_checks(model_dir, local):
    cfg_runners = local([[0, 2], [2, 4]])
    r0, r1 = cfg_runners.runners
    h = r1.hello()
    fp = load_checkpoint(model_dir).fingerprint()[:16]
    cfg = r1.cfg
    assert h["stage"] == 1 and h["layers"] == [2, 4] and h["model_layers"] == 4
    assert h["model_fp"] == fp == r0.hello()["model_fp"]
    assert h["config_fp"] == cfg.fingerprint()
    assert {k: h["pool"][k] for k in ("n_chunks", "chunk_cells", "table_chunks", "kv_dtype")} == \
        {"n_chunks": 12, "chunk_cells": 16, "table_chunks": 4, "kv_dtype": "float32"}
    assert h["device"] == "cpu" and h["version"] == 0 and h["protocol"] == PROTOCOL and isinstance(h["pid"], int)
    assert h["pool"]["reattached"] is False


def test_ops_land_in_fixed_address_tables(local):
    m = local([[0, 4]])
    r = m.runners[0]
    addr = r.kv.tables.data_ptr()
    trash = r.kv.trash
    assert r.kv.tables.tolist() == [[trash] * 4] * 4
    m.map.reserve(1, 20)
    m.map.reserve(0, 40)
    m.sync()
    assert r.kv.tables[1].tolist() == m.map.entries(1) == [0, 1, trash, trash]
    assert r.kv.tables[0].tolist() == m.map.entries(0) == [2, 3, 4, trash]
    park = m.map.new_table()
    m.map.swap(0, park)
    m.map.swap(park, 3)
    m.sync()
    assert r.kv.tables[0].tolist() == [trash] * 4 and r.kv.tables[3].tolist() == [2, 3, 4, trash]
    assert r.version == m.map.version and r.kv.tables.data_ptr() == addr
    r.load_snapshot(m.map.snapshot_ops())
    assert r.kv.tables.tolist() == [m.map.entries(s) for s in range(4)]
    r.reset()
    assert r.version == 0 and r.kv.tables.tolist() == [[trash] * 4] * 4 and r.kv.tables.data_ptr() == addr


def test_an_op_gap_is_refused_and_changes_nothing(local):
    m = local([[0, 4]])
    r = m.runners[0]
    m.map.reserve(0, 16)
    m.map.reserve(1, 16)
    ops = m.map.drain_ops()
    with pytest.raises(OpGap):
        r.apply(ops[1])
    assert r.version == 0 and r.kv.tables[1].tolist() == [r.kv.trash] * 4


def _pool_digest(r: StageRunner) -> str:
    return hashlib.sha256(bytes(r.memory.buffer)).hexdigest()


def test_a_stale_step_is_refused_and_writes_nothing(local):
    m = local([[0, 4]])
    r = m.runners[0]
    assert m.map.reserve(0, len(PROMPT_B))
    ops = m.map.drain_ops()
    before = _pool_digest(r)
    header = {"step": 1, "version": m.map.version, "slots": [[0, 0, len(PROMPT_B), 1]], "sampling": {0: GREEDY}}
    ids = torch.tensor(PROMPT_B, dtype=torch.int32)
    with pytest.raises(StaleStep, match=r"needs table version 1 but this stage has applied ops up to version 0"):
        r.step(header, ids, None)
    assert _pool_digest(r) == before
    for op in ops:
        r.apply(op)
    assert r.step(header, ids, None)[0][0] == 0
    assert _pool_digest(r) != before
    with pytest.raises(StaleStep):  # an older version is as stale as a newer one
        r.step({**header, "step": 2, "version": 0}, ids, None)


def test_kv_lives_in_the_pool_file(local, tmp_path):
    m = local([[0, 4]])
    r = m.runners[0]
    m.generate(1, PROMPT_A, 2)  # cells [0, 20) of slot 1: chunks 0 and 1
    layout = r.memory.layout
    with PoolMemory.attach(tmp_path / "pool0", layout) as other:  # a second, independent mapping
        for layer in range(layout.n_layers):
            k = pool_array(other, layer, "k")
            assert torch.equal(k, r.kv.k[layer])
            assert k[0].abs().sum() > 0 and k[1, :4].abs().sum() > 0  # cells 16..19 live in chunk 1
            assert k[1, 4:].abs().sum() == 0 and k[2:].abs().sum() == 0  # nothing else was written
        del k


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """The oracle: transformers' own greedy generation on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_split_in_process_matches_one_stage_and_transformers(model_dir, local):
    whole = local([[0, 4]])
    split = local([[0, 1], [1, 3], [3, 4]], pool=False)
    want = whole.generate(0, PROMPT_A, 12)
    assert split.generate(2, PROMPT_A, 12) == want
    assert hf_greedy(model_dir, PROMPT_A, 13) == want


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "no-pool"])
def test_a_moved_conversation_keeps_its_kv(local, pool):
    """Slot 0 -> parked table -> slot 2 (pool: table swaps; no pool: byte exchanges), then decode on."""
    ref = local([[0, 2], [2, 4]], pool=pool)
    want = ref.generate(0, PROMPT_A, 10)
    m = local([[0, 2], [2, 4]], pool=pool)
    got = m.generate(0, PROMPT_A, 4)
    park = m.map.new_table()
    m.map.swap(0, park)
    m.map.swap(park, 2)
    ops = m.map.drain_ops()
    assert ("exchange" in {op[0] for op in ops}) == (not pool)  # the baseline copies bytes, the pool does not
    for op in ops:
        for r in m.runners:
            r.apply(op)
    got += m.decode(2, len(PROMPT_A) + 4, got[-1], 6, sampling={2: dict(GREEDY)})
    assert got == want


def test_a_restarted_stage_reattaches_its_pool(model_dir, tmp_path):
    """A crash leaves the pool file; the next runner maps the same bytes and, given the tables, decodes on."""
    cfg = make_cfg(model_dir, [[0, 4]])
    a = Local(cfg, tmp_path)
    want = a.generate(0, PROMPT_A, 8)
    a.close()
    b = Local(cfg, tmp_path)
    got = b.generate(0, PROMPT_A, 3)
    b.close(unlink=False)  # the crash: the file stays
    c = Local(cfg, tmp_path)
    try:
        r = c.runners[0]
        assert r.hello()["pool"]["reattached"] is True
        c.map = b.map  # the coordinator's tables outlive the stage
        r.load_snapshot(c.map.snapshot_ops())
        got += c.decode(0, len(PROMPT_A) + 3, got[-1], 5, sampling={0: dict(GREEDY)})
        assert got == want
    finally:
        c.close()
    assert not (tmp_path / "pool0").exists()  # a clean close removes the file


def test_int8_kv_and_bf16_model_run(local):
    m = local([[0, 2], [2, 4]], kv_dtype="int8", dtype="bfloat16")
    h = m.runners[0].hello()
    assert h["pool"]["kv_dtype"] == "int8" and h["dtype"] == "bfloat16"
    out = m.generate(0, PROMPT_B, 4)
    assert len(out) == 5 and all(isinstance(t, int) for t in out)


def test_layers_outside_the_model_fail_to_build(model_dir, tmp_path):
    cfg = make_cfg(model_dir, [[0, 2], [2, 5]])
    with pytest.raises(ConfigError, match=r"stages\.1\.layers=\[2, 5\) but the model has 4 layers"):
        StageRunner(cfg, 1, pool_path=tmp_path / "p")


def test_bad_slot_entries_are_refused(local):
    m = local([[0, 4]])
    r = m.runners[0]
    with pytest.raises(ValueError, match="slot 7 does not exist"):
        r.check_step({"step": 1, "version": 0, "slots": [[7, 0, 1, 1]]})
    with pytest.raises(ValueError, match="reaches cell 65, max_context is 64"):
        r.check_step({"step": 1, "version": 0, "slots": [[0, 60, 5, 1]]})


def test_a_prompt_read_in_pieces_samples_only_at_its_end(local):
    """Steps that carry prompt pieces only return no rows; the tokens equal one whole-prompt read."""
    whole = local([[0, 4]])
    want = whole.generate(0, PROMPT_A, 3)
    pieces = local([[0, 2], [2, 4]])
    assert pieces.step([[0, 0, 9, 0]], PROMPT_A[:9], {0: dict(GREEDY)}) == []
    first = pieces.step([[0, 9, 8, 1]], PROMPT_A[9:])[0][1]
    assert [first, *pieces.decode(0, len(PROMPT_A), first, 3)] == want
