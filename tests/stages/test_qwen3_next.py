"""Qwen3-Next stages (Gated DeltaNet linear attention, gated full attention, MoE with a shared expert) against
transformers on the same random checkpoints, the delta rule's three forms against each other, the state pool's
rules, tiny Qwen3-Next checkpoints through the runners, and the configs the stages refuse.

Every KV cache and state pool starts filled with noise, so a step that reads a state it should not (a fresh
slot, another slot's entry) or a cell through a wrong table shows up in the logits.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from coordinator import config_check
from pool.config import ConfigError, config_from_dict
from pool.layer_kinds import LinearGeometry, state_entry_bytes
from pool.memory import PoolLayout
from stages.batch import StepBatch
from stages.checkpoint import CheckpointError, load_checkpoint
from stages.kv_cache import KVCache
from stages.linear_attention import chunked_delta_rule, linear_attention, recurrent_step
from stages.model import StageModel
from stages.state_pool import UNKNOWN, StatePool
from stages.tiny import make_tiny_model, tiny_config
from tests.stages.harness import GREEDY, Local, make_cfg
from tests.stages.test_model_vs_transformers import (
    ATOL, CHUNK, N_CHUNKS, N_SLOTS, TABLE_CHUNKS, VOCAB, hf_logits, prompt_ids, random_tables, run_one,
)

GEOMETRY = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": VOCAB, "max_position_embeddings": 512, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48}
# name -> (layers, config keywords). "main": layer_types from the default interval (L L L F L L), one dense MLP;
# "gated-bias": full attention first and last, q/k/v/o biases, head_dim apart from hidden / heads, raw top-k.
VARIANTS = {
    "main": (6, {"head_dim": 16, "mlp_only_layers": [1]}),
    "gated-bias": (4, {"head_dim": 32, "attention_bias": True, "norm_topk_prob": False,
                       "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"]}),
}


def build_hf_next(path, layers: int, seed: int = 0, **extra) -> Qwen3NextForCausalLM:
    """A seeded random transformers Qwen3-Next saved at `path`. Weights ~ N(0, 0.15^2); the (1 + w) norms get
    w ~ N(0, 0.2^2), the gated norm 1 + N(0, 0.2^2); A_log ~ -3 + N(0, 1), so a state remembers tens of tokens."""
    config = Qwen3NextConfig(num_hidden_layers=layers, **{**GEOMETRY, **extra})
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(-3.0 + torch.randn_like(p))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def hf_next(tmp_path_factory):
    """`hf_next(variant) -> (transformers model, checkpoint dir)`, built once per variant."""
    built: dict = {}

    def get(variant: str):
        if variant not in built:
            layers, kw = VARIANTS[variant]
            path = tmp_path_factory.mktemp(variant)
            built[variant] = (build_hf_next(path, layers, **kw), path)
        return built[variant]

    return get


class Hybrid:
    """StageModels over consecutive layer ranges, each with a noise-filled KV cache and state pool."""

    def __init__(self, ckpt_dir, splits: list[int], n_entries: int = N_SLOTS, seed: int = 0) -> None:
        ckpt = load_checkpoint(ckpt_dir)
        bounds = [0, *splits, ckpt.num_layers]
        self.models = [StageModel(ckpt, a, b, "cpu", torch.float32) for a, b in zip(bounds, bounds[1:])]
        g = torch.Generator().manual_seed(seed)
        self.kvs, self.states = [], []
        for m in self.models:
            kv = KVCache(m.num_kv_layers, N_CHUNKS, CHUNK, m.kv_heads, m.head_dim, "float32", "cpu", N_SLOTS,
                         TABLE_CHUNKS)
            for arr in kv.arrays():
                arr.copy_(torch.randn(arr.shape, generator=g) * 3)
            state = m.new_state_pool(n_entries)
            if state is not None:
                state.conv.copy_(torch.randn(state.conv.shape, generator=g) * 3)
                state.recurrent.copy_(torch.randn(state.recurrent.shape, generator=g) * 3)
            self.kvs.append(kv)
            self.states.append(state)

    def set_table(self, slot: int, chunks: list[int]) -> None:
        for kv in self.kvs:
            kv.set_table(slot, chunks + [N_CHUNKS] * (TABLE_CHUNKS - len(chunks)))

    def step(self, slots: list, ids: list[int], logits_all: bool = False, entries: list[int] | None = None):
        batch = StepBatch.from_slots(slots, state_entries=entries)
        x = torch.tensor(ids, dtype=torch.int32)
        for m, kv, state in zip(self.models, self.kvs, self.states):
            x = m.forward(batch, kv, x, logits_all=logits_all, state=state)
        return x


def test_the_stage_reads_the_layer_kinds_and_puts_only_full_attention_in_the_pool(hf_next):
    model, path = hf_next("main")
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2
    stage = StageModel(load_checkpoint(path), 2, 6)
    assert stage.kv_layers == [None, 0, None, None] and stage.linear_layers == [0, None, 1, 2]
    assert stage.num_kv_layers == 1 and stage.new_state_pool(3).recurrent.shape == (3, 3, 4, 16, 8)
    only_linear = StageModel(load_checkpoint(path), 0, 3)
    assert only_linear.num_kv_layers == 0 and only_linear.num_linear_layers == 3
    assert StageModel(load_checkpoint(path), 3, 4).new_state_pool(3) is None


@pytest.mark.parametrize("variant, splits", [("main", []), ("main", [2]), ("main", [3]), ("main", [4, 5]),
                                             ("gated-bias", []), ("gated-bias", [1])])
def test_prefill_in_pieces_and_greedy_decode_match_transformers(hf_next, variant, splits):
    model, path = hf_next(variant)
    stack = Hybrid(path, splits)
    (table,) = random_tables(seed=len(variant) + len(splits), sizes=[8])  # 128 cells
    stack.set_table(2, table)
    prompt = prompt_ids(1, 100)
    ours, tokens = run_one(stack, 2, prompt, [37, 41, 22], 24)
    ref = hf_logits(model, prompt + tokens)
    dev = (ours - ref).abs().max().item()
    print(f"{variant} {splits}: max |logit diff| vs transformers {dev:.2e} (logit std {ref.std():.3f})")
    assert ours.shape == (124, VOCAB)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert ref[99:123].argmax(-1).tolist() == tokens
    assert len(set(tokens)) > 3


def test_one_piece_pieces_and_token_by_token_agree(hf_next):
    model, path = hf_next("main")
    prompt = prompt_ids(7, 90)
    ref = hf_logits(model, prompt)
    runs = {}
    for name, pieces in {"one": [90], "pieces": [1, 5, 64, 20], "tokens": [1] * 90}.items():
        stack = Hybrid(path, [3], seed=len(name))
        stack.set_table(1, random_tables(seed=3, sizes=[6])[0])
        runs[name], _ = run_one(stack, 1, prompt, pieces, 0)
        torch.testing.assert_close(runs[name], ref, atol=ATOL, rtol=0)
    for name in ("pieces", "tokens"):  # float32 rounding only: transformers itself is ~3e-5 from float64 here
        dev = (runs[name] - runs["one"]).abs().max().item()
        print(f"{name} vs one piece: max |logit diff| {dev:.2e}")
        assert dev < 5e-5


def test_greedy_continuation_equals_transformers_generate(hf_next):
    model, path = hf_next("gated-bias")
    prompt = prompt_ids(11, 23)
    stack = Hybrid(path, [2])
    stack.set_table(0, random_tables(seed=4, sizes=[4])[0])
    _, tokens = run_one(stack, 0, prompt, [23], 31)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=31, min_new_tokens=31, do_sample=False,
                             pad_token_id=0)
    assert tokens == out[0, len(prompt):].tolist()
    assert len(set(tokens)) > 3


def test_slots_in_mixed_steps_give_each_slot_alone_logits(hf_next):
    """Four slots whose steps mix prefill pieces (one past a decode, one over two chunks) and decodes, on state
    entries other than their slots, give row for row what each gives alone."""
    _, path = hf_next("main")
    # Each slot's prompt pieces, then one token per step; 0: not in that step. Slot 2 reads a piece after decodes.
    pieces = {0: [13, 17], 1: [5], 2: [1, 1, 7], 3: [0, 70]}
    lengths, n_decode = [sum(p) for p in pieces.values()], 10
    prompts = [prompt_ids(30 + s, n) for s, n in enumerate(lengths)]
    tables = random_tables(seed=12, sizes=[6, 6, 6, 6])
    alone, seqs = [], []
    for slot in range(4):
        stack = Hybrid(path, [2], seed=slot)
        stack.set_table(slot, tables[slot])
        logits, tokens = run_one(stack, slot, prompts[slot], [n for n in pieces[slot] if n], n_decode)
        alone.append(logits)
        seqs.append(prompts[slot] + tokens)
    entries = {0: 3, 1: 0, 2: 4, 3: 1}
    stack = Hybrid(path, [2], n_entries=5, seed=9)
    for slot in range(4):
        stack.set_table(slot, tables[slot])
    pos, rows = [0] * 4, {s: [] for s in range(4)}
    step = 0
    while any(pos[s] < len(seqs[s]) for s in range(4)):
        order = [s for s in (2, 0, 3, 1) if pos[s] < len(seqs[s])]
        want = {s: pieces[s][step] if step < len(pieces[s]) else 1 for s in order}
        order = [s for s in order if want[s]]
        slots = [[s, pos[s], want[s], 1] for s in order]
        out = stack.step(slots, [t for s in order for t in seqs[s][pos[s]:pos[s] + want[s]]], logits_all=True,
                         entries=[entries[s] for s in order])
        at = 0
        for s in order:
            rows[s].append(out[at:at + want[s]])
            at += want[s]
            pos[s] += want[s]
        step += 1
    for slot in range(4):
        together = torch.cat(rows[slot])
        print(f"slot {slot}: max |logit diff| together vs alone {(together - alone[slot]).abs().max().item():.2e}")
        # float32 rounding of matmuls over other row counts (experts, conv) only; a wrong state would be O(1)
        torch.testing.assert_close(together, alone[slot], atol=3e-5, rtol=0, msg=f"slot {slot}")
        assert together[lengths[slot] - 1:-1].argmax(-1).tolist() == seqs[slot][lengths[slot]:]


# --- the layer --------------------------------------------------------------------------------------------

def naive_delta_rule(q, k, v, g, beta, state):
    """The recurrence itself, one token and one head at a time in float64 (q already scaled)."""
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, state))
    b, h, t, _ = k.shape
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    s = s.clone()
    for i in range(b):
        for j in range(h):
            for n in range(t):
                s[i, j] *= torch.exp(g[i, j, n])
                s[i, j] += torch.outer(k[i, j, n], beta[i, j, n] * (v[i, j, n] - s[i, j].T @ k[i, j, n]))
                out[i, j, n] = s[i, j].T @ q[i, j, n]
    return out, s


@pytest.mark.parametrize("chunk", [4, 16, 64])
def test_delta_rule_chunked_equals_recurrent_equals_the_naive_loop(chunk):
    gen = torch.Generator().manual_seed(chunk)
    b, h, t, dk, dv = 2, 3, 64, 8, 6
    q = F.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(b, h, t, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, t, dv, generator=gen)
    g = -torch.rand(b, h, t, generator=gen) * 0.3
    beta = torch.rand(b, h, t, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    want, want_state = naive_delta_rule(q, k, v, g, beta, state)

    chunked, chunked_state = chunked_delta_rule(q, k, v, g, beta, state, chunk)
    s, steps = state, []
    for n in range(t):
        o, s = recurrent_step(q[:, :, n], k[:, :, n], v[:, :, n], g[:, :, n], beta[:, :, n], s)
        steps.append(o)
    recurrent = torch.stack(steps, dim=2)
    for got, got_state in ((chunked, chunked_state), (recurrent, s)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(got_state.double(), want_state, atol=1e-5, rtol=0)
    # transformers' own chunked form (it scales and repeats internally; no l2norm asked for).
    hf, hf_state = torch_chunk_gated_delta_rule(q.transpose(1, 2) * dk**0.5, k.transpose(1, 2), v.transpose(1, 2),
                                                g.transpose(1, 2), beta.transpose(1, 2), chunk_size=chunk,
                                                initial_state=state, output_final_state=True)
    torch.testing.assert_close(hf.transpose(1, 2).double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(hf_state.double(), want_state, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="not a whole number of chunks"):
        chunked_delta_rule(q[:, :, :5], k[:, :, :5], v[:, :, :5], g[:, :, :5], beta[:, :, :5], state, 4)


def test_a_linear_layer_over_mixed_entries_matches_the_transformers_module(hf_next):
    """Layer 0's mixer on one step of three fresh entries (70, 1 and 6 tokens) against transformers' module on
    each sequence alone."""
    model, path = hf_next("main")
    stage = StageModel(load_checkpoint(path), 0, 1)
    lens = [70, 1, 6]
    h = torch.randn(sum(lens), 64, generator=torch.Generator().manual_seed(2))
    batch = StepBatch.from_slots([[s, 0, n, 1] for s, n in enumerate(lens)], state_entries=[2, 0, 1])
    state = stage.new_state_pool(3)
    state.recurrent.normal_()
    got = linear_attention(h, stage.layers[0], stage.spec.linear, batch, state, 0)
    module = model.model.layers[0].linear_attn
    with torch.no_grad():
        want = torch.cat([module(x[None])[0] for x in h.split(lens)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# --- the state pool ---------------------------------------------------------------------------------------

def test_state_entries_continue_only_where_they_stopped(hf_next):
    _, path = hf_next("main")
    stack = Hybrid(path, [3], n_entries=2)
    stack.set_table(0, random_tables(seed=1, sizes=[4])[0])
    ids = prompt_ids(5, 20)
    stack.step([[0, 0, 10, 1]], ids[:10], entries=[1])
    with pytest.raises(ValueError, match="state entry 1 holds the state after 10 tokens, but the step continues at "
                                         "position 12"):
        stack.step([[0, 12, 2, 1]], ids[12:14], entries=[1])
    with pytest.raises(ValueError, match="state entry 0 holds the state after 0 tokens"):
        stack.step([[0, 10, 2, 1]], ids[10:12], entries=[0])
    with pytest.raises(ValueError, match="state entry 2 does not exist"):
        stack.step([[0, 0, 2, 1]], ids[:2], entries=[2])
    with pytest.raises(ValueError, match="none twice"):
        StepBatch.from_slots([[0, 0, 2, 1], [1, 0, 2, 1]], state_entries=[1, 1])
    first = stack.step([[0, 10, 2, 1]], ids[10:12], entries=[1])  # continues: fine
    stack.states[0].forget()
    with pytest.raises(ValueError, match="state entry 1 holds no valid state"):
        stack.step([[0, 12, 2, 1]], ids[12:14], entries=[1])
    again = Hybrid(path, [3], n_entries=2)
    again.set_table(0, random_tables(seed=1, sizes=[4])[0])
    again.step([[0, 0, 10, 1]], ids[:10], entries=[0])
    torch.testing.assert_close(again.step([[0, 10, 2, 1]], ids[10:12], entries=[0]), first, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="needs a state pool"):
        stack.models[0].forward(StepBatch.from_slots([[0, 0, 2, 1]]), stack.kvs[0], torch.tensor(ids[:2]))


def test_entry_bytes_follow_the_formula(hf_next):
    model, path = hf_next("main")
    conf = json.loads((path / "config.json").read_text())
    stage = StageModel(load_checkpoint(path), 2, 6)  # 3 linear layers
    pool = stage.new_state_pool(2)
    assert pool.entry_nbytes == state_entry_bytes(conf, 2, 6, 4) == 3 * (3 * 96 * 4 + 4 * 4 * 16 * 8)
    assert state_entry_bytes(conf, 3, 4, 4) == 0
    big = {"architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 48, "linear_num_key_heads": 16,
           "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_conv_kernel_dim": 4, "full_attention_interval": 4}
    assert state_entry_bytes(big, 0, 48, 2) == 77_266_944


# --- tiny checkpoints, runners, config check --------------------------------------------------------------

def test_tiny_spec_serves_through_the_runners_as_transformers_generates(monkeypatch, tmp_path):
    """`model: "tiny:arch=qwen3_next,..."` builds a checkpoint transformers loads without a missing key; served
    by a stage of linear layers only (no K/V arrays in its pool file) and a stage ending in full attention, it
    gives transformers' greedy tokens, again after the slot starts over."""
    from stages.tiny import ensure_tiny

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    spec = "tiny:arch=qwen3_next,hidden=64,seed=5"
    model, info = AutoModelForCausalLM.from_pretrained(ensure_tiny(spec), dtype=torch.float32,
                                                       output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(kind), (kind, info[kind])
    assert model.eval().config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    prompt = [5, 17, 99, 3, 250, 41, 8, 77, 120, 6, 33]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                             pad_token_id=0)
    m = Local(make_cfg(spec, [[0, 3], [3, 4]]), tmp_path)  # type: ignore[arg-type]
    try:
        assert m.runners[0].memory.layout.n_layers == 0 and m.runners[1].memory.layout.n_layers == 1
        assert m.runners[0].kv.arrays() == [] and m.runners[0].state.n_layers == 3
        first = m.generate(1, prompt, 9)
        assert first == out[0, len(prompt):].tolist()
        assert m.generate(1, prompt, 9) == first  # position 0 again: a fresh state, whatever the entry held
        m.runners[0].reset("another-session")
        e = m.runners[0].cfg.engine
        entries = e.n_state_entries + e.n_state_checkpoints  # 2 x parallel each by default
        assert m.runners[0].state.held() == [UNKNOWN] * entries  # a new session's entries continue nothing of the old
    finally:
        m.close()


def test_config_check_counts_only_full_attention_layers(tmp_path):
    d = make_tiny_model(tmp_path / "m", arch="qwen3_next", layers=8, hidden=64)
    data = {"model": str(d), "engine": {"max_context": 64, "chunk_cells": 16, "kv_pool_tokens": 64, "parallel": 2,
                                        "prefill_chunk": 16},
            "stages": [{"layers": [0, 3], "endpoint": "ipc:///tmp/q3n-check-0"},
                       {"layers": [3, 8], "endpoint": "ipc:///tmp/q3n-check-1"}]}
    report = config_check.check(config_from_dict(data))
    per_layer = PoolLayout(1, 4, 16, 2, 16, "float32").data_nbytes
    assert [s.pool_bytes for s in report.stages] == [0, 2 * per_layer]  # layers 3 and 7 are full attention
    assert all(s.weight_bytes for s in report.stages)
    # the state pool: 2 x parallel entries and 2 x parallel checkpoints, what a real StatePool of the stage's
    # linear layers allocates
    conf = json.loads((d / "config.json").read_text())
    for s, n_linear in zip(report.stages, (3, 3)):  # 0-2 and 4-6
        pool = StatePool(8, n_linear, LinearGeometry.from_config(conf), torch.float32, "cpu")
        assert (s.state_entries, s.state_checkpoints) == (4, 4)
        assert s.state_bytes == sum(t.numel() * t.element_size() for t in (pool.conv, pool.recurrent))
    assert "linear-attention state 4 entries (engine.state_entries) + 4 checkpoints" in \
        config_check.format_report(report)
    data["engine"]["state_checkpoints"] = 0  # none: the entries alone
    assert [s.state_bytes for s in config_check.check(config_from_dict(data)).stages] == [s.state_bytes // 2
                                                                                         for s in report.stages]


BAD = {  # changes to a valid tiny qwen3_next config.json -> what the message must name
    "unknown-kind": ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]},
                     "layer_types[1] = 'mamba'"),
    "kinds-length": ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries but num_hidden_layers is 4"),
    "interval": ({"full_attention_interval": 0}, "full_attention_interval=0"),
    "value-heads": ({"linear_num_value_heads": 3}, "linear_num_value_heads=3 is not a multiple"),
    "odd-rotary": ({"partial_rotary_factor": 0.1875}, "partial_rotary_factor=0.1875 gives a rotary part of 3"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_qwen3_next_config_the_stages_cannot_compute_is_refused_naming_it(tmp_path, case):
    changes, named = BAD[case]
    d = tmp_path / case
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**tiny_config("qwen3_next", layers=4), **changes}))
    with pytest.raises(CheckpointError, match="config.json") as e:
        load_checkpoint(d)
    assert named in str(e.value)
    data = {"model": str(d), "engine": {"max_context": 64, "chunk_cells": 16, "kv_pool_tokens": 64, "parallel": 2,
                                        "prefill_chunk": 16},
            "stages": [{"layers": [0, 4], "endpoint": "ipc:///tmp/q3n-refusal-0"}]}
    with pytest.raises(ConfigError) as e:
        config_check.check(config_from_dict(data))
    assert e.value.key == "model" and named in str(e.value)


def test_a_kept_checkpoint_restored_into_an_entry_continues_as_transformers(tmp_path):
    """stages/state_pool.py rule 4 through the runners: a step that reaches position 16 keeps the row's state in
    a checkpoint entry (`keep`); after the slot's entry moved on to 24 tokens, a step from 16 that restores the
    checkpoint into it (`restore`) continues a branch as transformers does on prefix + branch. Copies that name
    no entry, or a row outside the step, are refused before anything runs."""
    d = make_tiny_model(tmp_path / "m", arch="qwen3_next", layers=4, hidden=64, seed=3)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    prompt = prompt_ids(9, 24)
    branch = [7, 250, 31, 64]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt[:16] + branch]), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, pad_token_id=0)
    m = Local(make_cfg(d, [[0, 2], [2, 4]]), tmp_path)  # type: ignore[arg-type]  # linear layers on both
    try:
        e = m.runners[0].cfg.engine
        ckpt = e.n_state_entries  # the first checkpoint entry
        assert all(r.state.n_entries == e.n_state_entries + e.n_state_checkpoints for r in m.runners)
        m.step([[1, 0, 16, 0]], prompt[:16], keep=[[0, ckpt]])
        assert [r.state.tokens[ckpt] for r in m.runners] == [16, 16]
        m.step([[1, 16, 8, 0]], prompt[16:24])
        before = [list(r.state.tokens) for r in m.runners]
        for bad, match in (({"keep": [[1, ckpt]]}, "names a row outside"),
                           ({"restore": [[ckpt, 99]]}, "entry 99 does not exist")):
            with pytest.raises(ValueError, match=match):
                m.runners[0].step({"step": 99, "version": m.map.version, "slots": [[1, 24, 1, 0]], "sampling": {},
                                   **bad}, torch.tensor([5], dtype=torch.int32), None)
        assert [list(r.state.tokens) for r in m.runners] == before
        first = m.step([[1, 16, 4, 1]], branch, {1: dict(GREEDY)}, restore=[[ckpt, 1]])[0][1]
        got = [first, *m.decode(1, 20, first, 5)]
        assert got == out[0, 20:].tolist()
    finally:
        m.close()
