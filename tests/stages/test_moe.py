"""Qwen2-MoE and Qwen3-MoE stages against transformers (the oracle), the grouped expert dispatch against a
per-token reference, the weights a stage loads, tiny MoE checkpoints, and slots decoding together vs alone.

The oracle checkpoints are random transformers models saved with `save_pretrained` (per-expert tensor names,
as on the Hub); the harness (Stack, run_one, ...) is the dense oracle tests' own: noise-filled pools, tables of
non-adjacent chunks in random order, prefill in pieces, then greedy decode through the paged KV cache.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from stages import moe
from stages.checkpoint import Checkpoint, load_checkpoint
from stages.model import StageModel
from tests.stages.harness import Local, make_cfg
from tests.stages.test_model_vs_transformers import (
    ATOL, VOCAB, Stack, build_hf_model, hf_logits, prompt_ids, random_tables, run_one,
)

HF = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM), "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM)}
MOE_SHAPE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# (arch, layers, config keywords); names are the test ids.
VARIANTS = {
    "qwen3_moe": ("qwen3_moe", 3, {"norm_topk_prob": True}),
    "qwen3_moe-raw-topk": ("qwen3_moe", 3, {"norm_topk_prob": False}),
    # Layers 1 and 3 route ((i + 1) % 2 == 0), layer 3 is listed dense: only layer 1 routes.
    "qwen3_moe-sparse-step-mlp-only": ("qwen3_moe", 4, {"norm_topk_prob": True, "decoder_sparse_step": 2,
                                                         "mlp_only_layers": [3]}),
    "qwen3_moe-sliding": ("qwen3_moe", 3, {"norm_topk_prob": True, "use_sliding_window": True,
                                           "sliding_window": 40}),
    "qwen2_moe": ("qwen2_moe", 3, {"shared_expert_intermediate_size": 48}),
    "qwen2_moe-norm-topk-mlp-only": ("qwen2_moe", 3, {"shared_expert_intermediate_size": 48, "norm_topk_prob": True,
                                                      "mlp_only_layers": [0]}),
    # layer_types from max_window_layers: layer 0 slides (transformers' Qwen2MoeConfig rule).
    "qwen2_moe-sliding": ("qwen2_moe", 3, {"shared_expert_intermediate_size": 48, "use_sliding_window": True,
                                           "sliding_window": 40, "max_window_layers": 2}),
}


def build_hf_moe(path, arch: str, layers: int, seed: int = 0, **extra):
    """A seeded random transformers MoE model saved at `path` (build_hf_model with the MoE shape)."""
    config_cls, model_cls = HF[arch]
    return build_hf_model(path, config_cls, model_cls, seed, layers, **{**MOE_SHAPE, **extra})


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """`hf_moe(variant) -> (transformers model, checkpoint dir)`, built once per variant."""
    built: dict = {}

    def get(variant: str):
        if variant not in built:
            arch, layers, kw = VARIANTS[variant]
            path = tmp_path_factory.mktemp(variant)
            built[variant] = (build_hf_moe(path, arch, layers, **kw), path)
        return built[variant]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("splits", [[], [1]], ids=["one-stage", "two-stages"])
def test_prefill_in_pieces_and_greedy_decode_match_transformers(hf_moe, variant, splits):
    model, path = hf_moe(variant)
    stack = Stack(path, splits)
    (table,) = random_tables(seed=len(variant), sizes=[11])  # 164 cells
    stack.set_table(2, table)
    prompt = prompt_ids(1, 100)
    ours, tokens = run_one(stack, 2, prompt, [37, 41, 22], 64)
    ref = hf_logits(model, prompt + tokens)
    dev = (ours - ref).abs().max().item()
    print(f"{variant} {splits}: max |logit diff| vs transformers {dev:.2e} (logit std {ref.std():.3f})")
    assert ours.shape == (164, VOCAB)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert ref[99:163].argmax(-1).tolist() == tokens
    assert len(set(tokens)) > 3


def test_the_variants_route_the_layers_they_claim(hf_moe):
    """The layer rule of each variant, read back from what the stage built (and what transformers built)."""
    for variant in VARIANTS:
        model, path = hf_moe(variant)
        ours = StageModel(load_checkpoint(path), 0, VARIANTS[variant][1])
        routed = ["experts.gate_up" in w for w in ours.layers]
        assert routed == [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers]
        if variant == "qwen3_moe-sparse-step-mlp-only":
            assert routed == [False, True, False, False]
        if variant == "qwen2_moe-norm-topk-mlp-only":
            assert routed == [False, True, True]
    assert StageModel(load_checkpoint(hf_moe("qwen2_moe-sliding")[1]), 0, 3).sliding_windows == (40, None, None)
    assert StageModel(load_checkpoint(hf_moe("qwen3_moe-sliding")[1]), 0, 3).sliding_windows == (40, 40, 40)


def test_qwen2_moe_sliding_rule_without_layer_types(hf_moe, tmp_path):
    """An old config.json without `layer_types`: the windows come from max_window_layers as transformers does."""
    model, path = hf_moe("qwen2_moe-sliding")
    conf = json.loads((path / "config.json").read_text())
    assert conf.pop("layer_types") == ["sliding_attention", "full_attention", "full_attention"]
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(conf))
    stack = Stack(tmp_path, [1])
    stack.set_table(0, random_tables(seed=2, sizes=[8])[0])
    prompt = prompt_ids(3, 90)
    ours, tokens = run_one(stack, 0, prompt, [50, 40], 16)
    torch.testing.assert_close(ours, hf_logits(model, prompt + tokens), atol=ATOL, rtol=0)


def test_a_stage_loads_only_its_layers_and_stacks_the_experts(hf_moe, monkeypatch):
    _, path = hf_moe("qwen2_moe")
    ckpt = load_checkpoint(path)
    asked: list[str] = []
    real = Checkpoint.tensors

    def spy(self, names, *a, **kw):
        names = list(names)
        asked.extend(names)
        return real(self, names, *a, **kw)

    monkeypatch.setattr(Checkpoint, "tensors", spy)
    stage = StageModel(ckpt, 1, 2)
    layers = {int(n.split(".")[2]) for n in asked if n.startswith("model.layers.")}
    assert layers == {1} and "model.embed_tokens.weight" not in asked and "lm_head.weight" not in asked
    assert sum(".mlp.experts." in n for n in asked) == 8 * 3
    w = stage.layers[0]
    raw = real(ckpt, [f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(8)
                      for p in ("gate_proj", "up_proj", "down_proj")])
    assert w["experts.gate_up"].shape == (8, 64, 64) and w["experts.down"].shape == (8, 64, 32)
    for e in range(8):
        p = f"model.layers.1.mlp.experts.{e}."
        assert torch.equal(w["experts.gate_up"][e], torch.cat([raw[p + "gate_proj.weight"], raw[p + "up_proj.weight"]]))
        assert torch.equal(w["experts.down"][e], raw[p + "down_proj.weight"])
    assert not any(k.startswith("mlp.experts.") for k in w)  # the per-expert copies are gone
    assert w["shared_expert.gate_up"].shape == (96, 64) and w["mlp.shared_expert_gate.weight"].shape == (1, 64)


# --- the grouped dispatch --------------------------------------------------------------------------------

def naive_experts(h, experts, weights, gate_up, down):
    """The rule itself, one token and one chosen expert at a time."""
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = gate_up[e, :inter] @ h[t], gate_up[e, inter:] @ h[t]
            out[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("n_tokens", [1, 3, 37])
def test_grouped_dispatch_matches_the_per_token_rule_with_one_matmul_pair_per_active_expert(n_tokens, monkeypatch):
    g = torch.Generator().manual_seed(n_tokens)
    n_experts, top_k, hidden, inter = 6, 2, 16, 8
    h = torch.randn(n_tokens, hidden, generator=g)
    gate_up = torch.randn(n_experts, 2 * inter, hidden, generator=g) * 0.3
    down = torch.randn(n_experts, hidden, inter, generator=g) * 0.3
    allowed = torch.tensor([0, 2, 3, 5])  # experts 1 and 4 get no token
    experts = torch.stack([allowed[torch.randperm(4, generator=g)[:top_k]] for _ in range(n_tokens)])
    weights = torch.rand(n_tokens, top_k, generator=g)
    want = naive_experts(h, experts, weights, gate_up, down)

    rows: list[int] = []
    linear = F.linear

    def counting(x, w, b=None):
        rows.append(x.shape[0])
        return linear(x, w, b)

    monkeypatch.setattr(moe.F, "linear", counting)
    got = moe.grouped_experts(h, experts, weights, gate_up, down)
    monkeypatch.undo()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    per_expert = torch.bincount(experts.reshape(-1), minlength=n_experts)
    active = [int(n) for n in per_expert if n]
    assert rows == [n for n in active for _ in range(2)]  # gate_up then down, over exactly its tokens
    assert sum(rows) == 2 * n_tokens * top_k


def test_route_picks_top_k_of_the_softmax_and_normalises_on_request():
    g = torch.Generator().manual_seed(0)
    h, router = torch.randn(5, 16, generator=g), torch.randn(6, 16, generator=g)
    probs = torch.softmax(h @ router.T, dim=-1)
    raw_w, raw_e = moe.route(h, router, 3, norm_topk_prob=False)
    want_w, want_e = probs.topk(3, dim=-1)
    assert torch.equal(raw_e, want_e)
    torch.testing.assert_close(raw_w, want_w, atol=1e-6, rtol=0)
    norm_w, norm_e = moe.route(h, router, 3, norm_topk_prob=True)
    assert torch.equal(norm_e, want_e)
    torch.testing.assert_close(norm_w, want_w / want_w.sum(-1, keepdim=True), atol=1e-6, rtol=0)
    torch.testing.assert_close(norm_w.sum(-1), torch.ones(5), atol=1e-6, rtol=0)


# --- tiny MoE checkpoints and serving ---------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_tiny_moe_checkpoint_loads_in_transformers_and_matches_our_stages(tiny_model_factory, arch):
    path = tiny_model_factory(arch, layers=4, hidden=64, heads=4, kv_heads=2, seed=3)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    model.eval()
    assert type(model).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[arch]
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(kind), (kind, info[kind])
    assert (model.config.num_experts, model.config.num_experts_per_tok, model.config.moe_intermediate_size) == (8, 2, 32)
    ckpt = load_checkpoint(path)
    vocab = int(ckpt.config["vocab_size"])
    stack = Stack(path, [2])
    stack.set_table(0, random_tables(seed=10, sizes=[4])[0])
    prompt = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    ours, tokens = run_one(stack, 0, prompt, [25, 15], 8)
    ref = hf_logits(model, prompt + tokens)
    print(f"tiny {arch}: max |logit diff| vs transformers {(ours - ref).abs().max().item():.2e}")
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_tiny_moe_geometry_options(tmp_path):
    from stages.tiny import tiny_config

    cfg = tiny_config("qwen3_moe", layers=4, experts=4, top_k=3, moe_intermediate=16, sparse_step=2)
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], cfg["decoder_sparse_step"]) \
        == (4, 3, 16, 2)
    assert cfg["norm_topk_prob"] is True and "shared_expert_intermediate_size" not in cfg
    q2 = tiny_config("qwen2_moe")
    assert q2["shared_expert_intermediate_size"] == 64 and q2["norm_topk_prob"] is False and q2["qkv_bias"] is True
    with pytest.raises(ValueError, match="only for the MoE archs"):
        tiny_config("qwen3", experts=4)
    with pytest.raises(ValueError, match="bad MoE geometry"):
        tiny_config("qwen3_moe", experts=2, top_k=3)


def test_tiny_spec_serves_through_the_runners(monkeypatch, tmp_path):
    """`model: "tiny:arch=qwen3_moe,..."` builds the checkpoint and serves it; tokens as transformers gives."""
    from stages.tiny import ensure_tiny

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    spec = "tiny:arch=qwen3_moe,hidden=64,seed=5"
    m = Local(make_cfg(spec, [[0, 2], [2, 4]]), tmp_path)  # type: ignore[arg-type]
    try:
        prompt = [5, 17, 99, 3, 250, 41, 8, 77, 120, 6, 33]
        got = m.generate(1, prompt, 9)
    finally:
        m.close()
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny(spec), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                             pad_token_id=0)
    assert got == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_slots_decoding_together_give_each_slot_alone_tokens(tiny_model_factory, tmp_path, arch):
    """Four slots prefilled in one step and decoded together (their tokens share expert matmuls) give, token for
    token, what each gives alone."""
    path = tiny_model_factory(arch, layers=4, hidden=64, heads=4, kv_heads=2, seed=4)
    prompts = [prompt_ids(40 + s, n) for s, n in enumerate([5, 17, 23, 30])]
    n_decode = 12
    alone = []
    for slot, prompt in enumerate(prompts):
        m = Local(make_cfg(path, [[0, 2], [2, 4]]), tmp_path, tag=f"a{slot}")
        try:
            alone.append(m.generate(slot, prompt, n_decode))
        finally:
            m.close()
    m = Local(make_cfg(path, [[0, 2], [2, 4]]), tmp_path, tag="t")
    try:
        order = [2, 0, 3, 1]  # not slot order: rows follow the header
        first = m.step([[s, 0, len(prompts[s]), 1] for s in order], [t for s in order for t in prompts[s]],
                       {s: {"temperature": 0.0} for s in order})
        together = {row[0]: [row[1]] for row in first}
        pos = {s: len(prompts[s]) for s in order}
        for _ in range(n_decode):
            rows = m.step([[s, pos[s], 1, 1] for s in order], [together[s][-1] for s in order])
            for row in rows:
                together[row[0]].append(row[1])
            for s in order:
                pos[s] += 1
    finally:
        m.close()
    for slot in range(4):
        assert together[slot] == alone[slot], f"slot {slot}"
    assert len({t for toks in alone for t in toks}) > 4
