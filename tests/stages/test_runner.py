"""StageRunner in-process: handshake fields, ops into fixed-address tables, refusal of stale steps, the pool
file as the K/V's home (re-attached after a crash), moves by swap and by byte exchange, and a split that
gives the same tokens as one stage."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from pool.chunk_map import OpGap
from pool.config import ConfigError
from pool.memory import PoolMemory
from pool.step_chain import CHAINED
from pool.wire import PROTOCOL
from stages.checkpoint import load_checkpoint
from stages.runner import StageRunner, StaleStep
from stages.tensors import pool_array
from tests.stages.harness import GREEDY, PROMPT_A, PROMPT_B, Local, make_cfg

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


def test_a_chained_step_reads_the_token_the_stage_sampled(local):
    """pool/step_chain.py rules 3-4 on a real stage: rows whose ids are CHAINED read the token the named step
    sampled for their slot, and the tokens equal plain decode steps; a step naming any other step, or sent to a
    stage that does not both embed and sample, is refused before anything runs."""
    want = local([[0, 4]]).generate(0, PROMPT_A, 4)
    m = local([[0, 4]])
    first = m.step([[0, 0, len(PROMPT_A), 1]], PROMPT_A, {0: dict(GREEDY)})[0][1]
    got, pos = [first], len(PROMPT_A)
    for _ in range(4):
        prev = m.step_id
        got.append(m.step([[0, pos, 1, 1]], [CHAINED], chain=[[0, prev]])[0][1])
        pos += 1
    assert got == want
    r = m.runners[0]
    stale = {"step": m.step_id + 1, "version": r.version, "slots": [[0, pos, 1, 1]], "chain": [[0, m.step_id - 1]]}
    with pytest.raises(ValueError, match="sampled nothing for it"):  # nothing runs: not even a sampler reset
        r.step({**stale, "sampling": {1: {"temperature": 0.7}}}, torch.tensor([CHAINED], dtype=torch.int32), None)
    assert r.sampler.params[1] is None
    with pytest.raises(ValueError, match="one token and sample"):
        r.step({**stale, "slots": [[0, pos, 1, 0]], "chain": [[0, m.step_id]]}, torch.tensor([CHAINED]), None)
    chained = {"step": 1, "version": 0, "slots": [[0, 0, 1, 1]], "chain": [[0, 0]]}
    for ranges, chain in (([[0, 4]], False), ([[0, 2], [2, 4]], False), ([[0, 2], [2, 4]], "auto")):
        for runner in local(ranges, chain_steps=chain).runners:
            with pytest.raises(ValueError, match="engine.chain_steps"):
                runner.check_step(chained)


def test_a_split_reads_chained_tokens_from_the_last_stages_samples(local):
    """Rule 4 on a layer split: the first stage fills chained rows from the samples the ring brought (recorded
    here as stages/compute.py records them); the other stages take the step's hidden states as any other."""
    want = local([[0, 4]]).generate(0, PROMPT_A, 4)
    split = local([[0, 2], [2, 4]], chain_steps=True)
    head = split.runners[0]
    out = split.step([[0, 0, len(PROMPT_A), 1]], PROMPT_A, {0: dict(GREEDY)})
    got, pos = [out[0][1]], len(PROMPT_A)
    for _ in range(4):
        head.samples.record(split.step_id, out)  # the SAMPLES of the step before
        out = split.step([[0, pos, 1, 1]], [CHAINED], chain=[[0, split.step_id]])
        got.append(out[0][1])
        pos += 1
    assert got == want
    with pytest.raises(ValueError, match="sampled nothing for it"):  # the ring has not brought the step before
        split.step([[0, pos, 1, 1]], [CHAINED], chain=[[0, split.step_id]])
