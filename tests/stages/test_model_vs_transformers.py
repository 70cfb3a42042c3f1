"""Our stage stack against transformers (the oracle): prefill in pieces, greedy decode, slots, rope, int8 KV.

Every checkpoint is a random transformers model saved with `save_pretrained` (the HF layout our loader reads);
the in-memory transformers model that wrote it computes the reference logits in one full-sequence forward.
Each slot's table is a random permutation of non-adjacent pool chunks, and the pool starts filled with noise,
so a read or write through a wrong cell shows up in the logits.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from stages.batch import StepBatch
from stages.checkpoint import load_checkpoint
from stages.kv_cache import KVCache
from stages.model import StageModel

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    # A window shorter than the test's sequences, so the sliding path is exercised.
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 40}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # head_dim from the config, not hidden / heads.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),
}
VOCAB = 256
CHUNK = 16
N_CHUNKS = 48
TABLE_CHUNKS = 16
N_SLOTS = 4
ATOL = 1e-4


def build_hf(path, arch: str, seed: int = 0, layers: int = 3, **extra):
    """A seeded random transformers model saved at `path`; weights larger than HF's init so logits spread."""
    config_cls, model_cls, arch_kw = ARCHS[arch]
    return build_hf_model(path, config_cls, model_cls, seed, layers, **{**arch_kw, **extra})


def build_hf_model(path, config_cls, model_cls, seed: int, layers: int, **extra):
    """`build_hf` for any transformers config and model class (the MoE tests use it too)."""
    config = config_cls(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, **{"max_position_embeddings": 512, **extra},
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """`hf_model(key, arch, **kw) -> (transformers model, checkpoint dir)`, built once per key."""
    built: dict = {}

    def get(key: str, arch: str, **kw):
        if key not in built:
            path = tmp_path_factory.mktemp(key)
            built[key] = (build_hf(path, arch, **kw), path)
        return built[key]

    return get


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


class Stack:
    """One or more StageModels over consecutive layer ranges, each with its own noise-filled KVCache."""

    def __init__(self, ckpt_dir, splits: list[int], kv_dtype: str = "float32", seed: int = 0,
                 dtype: torch.dtype = torch.float32, pack_weights: bool = True):
        ckpt = load_checkpoint(ckpt_dir)
        bounds = [0, *splits, ckpt.num_layers]
        self.models = [StageModel(ckpt, a, b, "cpu", dtype, pack_weights=pack_weights)
                       for a, b in zip(bounds, bounds[1:])]
        g = torch.Generator().manual_seed(seed)
        self.kvs = []
        for m in self.models:
            kv = KVCache(m.num_local_layers, N_CHUNKS, CHUNK, m.kv_heads, m.head_dim, kv_dtype, "cpu", N_SLOTS,
                         TABLE_CHUNKS)
            for arr in kv.arrays():
                if arr.dtype == torch.int8:
                    arr.copy_(torch.randint(-127, 128, arr.shape, generator=g, dtype=torch.int8))
                else:
                    arr.copy_(torch.randn(arr.shape, generator=g) * 3)
            self.kvs.append(kv)

    def set_table(self, slot: int, chunks: list[int]) -> None:
        entries = chunks + [N_CHUNKS] * (TABLE_CHUNKS - len(chunks))
        for kv in self.kvs:
            kv.set_table(slot, entries)

    def step(self, slots: list, ids: list[int], logits_all: bool = False) -> torch.Tensor:
        batch = StepBatch.from_slots(slots)
        x = torch.tensor(ids, dtype=torch.int32)
        for m, kv in zip(self.models, self.kvs):
            x = m.forward(batch, kv, x, logits_all=logits_all)
        return x


def random_tables(seed: int, sizes: list[int]) -> list[list[int]]:
    """Disjoint tables of non-adjacent chunks (even numbers only) in random order."""
    evens = list(range(0, N_CHUNKS, 2))
    random.Random(seed).shuffle(evens)
    out, at = [], 0
    for n in sizes:
        out.append(evens[at:at + n])
        at += n
    return out


def run_one(stack: Stack, slot: int, prompt: list[int], pieces: list[int], n_decode: int,
            forced: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Prefill `prompt` in `pieces`, then greedy decode (or feed `forced`); returns logits per position, tokens."""
    assert sum(pieces) == len(prompt)
    rows, start = [], 0
    for n in pieces:
        rows.append(stack.step([[slot, start, n, 1]], prompt[start:start + n], logits_all=True))
        start += n
    tokens: list[int] = []
    for i in range(n_decode):
        tok = forced[i] if forced is not None else int(rows[-1][-1].argmax())
        tokens.append(tok)
        rows.append(stack.step([[slot, start, 1, 1]], [tok]))
        start += 1
    return torch.cat(rows), tokens


def prompt_ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("splits", [[], [1]], ids=["one-stage", "two-stages"])
def test_prefill_in_pieces_and_greedy_decode_match_transformers(hf_model, arch, splits):
    model, path = hf_model(arch, arch)
    stack = Stack(path, splits)
    (table,) = random_tables(seed=len(arch), sizes=[11])  # 164 cells
    stack.set_table(2, table)
    prompt = prompt_ids(1, 100)
    ours, tokens = run_one(stack, 2, prompt, [37, 41, 22], 64)
    ref = hf_logits(model, prompt + tokens)
    assert ours.shape == (164, VOCAB)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert ref[99:163].argmax(-1).tolist() == tokens
    assert len(set(tokens)) > 3  # the model is not stuck on one token: the check above means something


def test_last_stage_returns_only_sampled_rows(hf_model):
    _, path = hf_model("qwen3", "qwen3")
    stack = Stack(path, [1])
    tables = random_tables(seed=5, sizes=[2, 2, 2])
    for slot, t in zip([0, 1, 3], tables):
        stack.set_table(slot, t)
    slots = [[0, 0, 7, 1], [1, 0, 5, 0], [3, 0, 9, 1]]
    batch_ids = prompt_ids(2, 21)
    hidden = stack.models[0].forward(StepBatch.from_slots(slots), stack.kvs[0], torch.tensor(batch_ids))
    assert hidden.shape == (21, 64)
    sampled = stack.step(slots, batch_ids)
    assert sampled.shape == (2, VOCAB) and sampled.dtype == torch.float32
    everything = stack.step(slots, batch_ids, logits_all=True)
    torch.testing.assert_close(sampled, everything[[6, 20]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_slots_decoding_together_match_each_slot_alone(hf_model, arch):
    _, path = hf_model(arch, arch)
    lengths, n_decode = [5, 23, 40, 61], 24
    tables = random_tables(seed=11, sizes=[6, 6, 6, 6])
    prompts = [prompt_ids(20 + s, n) for s, n in enumerate(lengths)]

    alone = []
    for slot in range(N_SLOTS):
        stack = Stack(path, [1])
        stack.set_table(slot, tables[slot])
        logits, tokens = run_one(stack, slot, prompts[slot], [lengths[slot]], n_decode)
        alone.append((logits[lengths[slot] - 1:], tokens))

    stack = Stack(path, [1], seed=1)  # different noise in the pool: it must not matter
    for slot in range(N_SLOTS):
        stack.set_table(slot, tables[slot])
    # Prefill: slots 0 and 2 whole, slots 1 and 3 in two pieces spread over two mixed steps.
    first = [[0, 0, 5, 1], [1, 0, 10, 0], [2, 0, 40, 1], [3, 0, 30, 0]]
    out = stack.step(first, prompts[0] + prompts[1][:10] + prompts[2] + prompts[3][:30])
    last = {0: out[0], 2: out[1]}  # sampled rows come in header order
    out = stack.step([[3, 30, 31, 1], [1, 10, 13, 1]], prompts[3][30:] + prompts[1][10:])
    last[3], last[1] = out[0], out[1]
    together: dict[int, tuple[list, list]] = {s: ([], []) for s in range(N_SLOTS)}
    pos = list(lengths)
    for _ in range(n_decode):
        order = [2, 0, 3, 1]  # not slot order: rows follow the header
        toks = [int(last[s].argmax()) for s in order]
        rows = stack.step([[s, pos[s], 1, 1] for s in order], toks)
        for i, s in enumerate(order):
            together[s][0].append(last[s])
            together[s][1].append(toks[i])
            last[s] = rows[i]
            pos[s] += 1
    for s in range(N_SLOTS):
        ref_logits, ref_tokens = alone[s]
        assert together[s][1] == ref_tokens, f"slot {s}"
        torch.testing.assert_close(torch.stack(together[s][0]), ref_logits[:n_decode], atol=1e-5, rtol=0)


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(hf_model, kind):
    model, path = hf_model(f"llama-{kind}", "llama", layers=2, rope_scaling=dict(ROPE_SCALINGS[kind]))
    stack = Stack(path, [])
    (table,) = random_tables(seed=3, sizes=[8])
    stack.set_table(0, table)
    prompt = prompt_ids(4, 100)
    ours, tokens = run_one(stack, 0, prompt, [60, 40], 16)
    torch.testing.assert_close(ours, hf_logits(model, prompt + tokens), atol=ATOL, rtol=0)


def test_dynamic_rope_matches_transformers_for_one_read(hf_model):
    """Dynamic NTK depends on the sequence length; one read of 120 tokens past max_position 64 agrees."""
    model, path = hf_model("llama-dynamic", "llama", layers=2, max_position_embeddings=64,
                           rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    stack = Stack(path, [])
    stack.set_table(1, random_tables(seed=6, sizes=[8])[0])
    prompt = prompt_ids(5, 120)
    ours = stack.step([[1, 0, 120, 1]], prompt, logits_all=True)
    torch.testing.assert_close(ours, hf_logits(model, prompt), atol=ATOL, rtol=0)


def test_tied_embeddings_match_transformers(hf_model):
    model, path = hf_model("qwen2-tied", "qwen2", layers=2, tie_word_embeddings=True)
    assert not load_checkpoint(path).has_tensor("lm_head.weight")
    stack = Stack(path, [1])
    stack.set_table(0, random_tables(seed=8, sizes=[4])[0])
    prompt = prompt_ids(6, 50)
    torch.testing.assert_close(stack.step([[0, 0, 50, 1]], prompt, logits_all=True), hf_logits(model, prompt),
                               atol=ATOL, rtol=0)


def test_int8_kv_stays_close_to_float32(hf_model):
    _, path = hf_model("qwen3", "qwen3")
    (table,) = random_tables(seed=9, sizes=[11])
    prompt = prompt_ids(7, 100)
    ref = Stack(path, [1])
    ref.set_table(0, table)
    ref_logits, tokens = run_one(ref, 0, prompt, [50, 50], 64)
    q8 = Stack(path, [1], kv_dtype="int8")
    q8.set_table(0, table)
    q8_logits, _ = run_one(q8, 0, prompt, [50, 50], 64, forced=tokens)
    steps = slice(99, 163)  # the 64 predictions made by decode steps (and the last prefill row)
    dev = (q8_logits[steps] - ref_logits[steps]).abs().max().item()
    agree = (q8_logits[steps].argmax(-1) == ref_logits[steps].argmax(-1)).float().mean().item()
    spread = ref_logits[steps].std().item()
    print(f"int8 KV vs float32 over 64 decode steps: max |logit dev| {dev:.4f} "
          f"(logit std {spread:.3f}), top-1 agreement {agree:.1%}")
    assert agree >= 0.9
    assert 0 < dev < 0.25 * spread


def test_bfloat16_error_is_no_worse_than_transformers_own(hf_model):
    """In bfloat16 both stacks round differently; ours must stray from float32 no more than transformers does."""
    model, path = hf_model("qwen3", "qwen3")
    (table,) = random_tables(seed=12, sizes=[11])
    prompt = prompt_ids(9, 100)
    ref = Stack(path, [1])
    ref.set_table(0, table)
    _, tokens = run_one(ref, 0, prompt, [37, 41, 22], 64)
    ours = Stack(path, [1], kv_dtype="bfloat16", dtype=torch.bfloat16)
    assert ours.models[0].embed.dtype == torch.bfloat16
    ours.set_table(0, table)
    ours16, _ = run_one(ours, 0, prompt, [37, 41, 22], 64, forced=tokens)
    exact = hf_logits(model, prompt + tokens)
    theirs16 = hf_logits(copy.deepcopy(model).to(torch.bfloat16), prompt + tokens)
    ours_err, theirs_err = (ours16 - exact).abs(), (theirs16 - exact).abs()
    print(f"bfloat16 vs float32 logits: ours mean {ours_err.mean():.4f} max {ours_err.max():.3f}, "
          f"transformers mean {theirs_err.mean():.4f} max {theirs_err.max():.3f}")
    assert 0 < ours_err.mean() <= 1.5 * theirs_err.mean()
    assert ours_err.max() <= 2 * theirs_err.max()


def test_checkpoint_from_tiny_maker_matches_transformers(request):
    """The product's own tiny checkpoints (stages.tiny) read the same through transformers and through us."""
    try:
        factory = request.getfixturevalue("tiny_model_factory")
    except pytest.FixtureLookupError:
        pytest.skip("tiny_model_factory (tests/conftest.py) is not available")
    path = factory("qwen3", layers=2, hidden=64, heads=4, kv_heads=2, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ckpt = load_checkpoint(path)
    vocab = int(ckpt.config["vocab_size"])
    stack = Stack(path, [1])
    stack.set_table(0, random_tables(seed=10, sizes=[4])[0])
    prompt = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    ours, tokens = run_one(stack, 0, prompt, [25, 15], 8)
    torch.testing.assert_close(ours, hf_logits(model, prompt + tokens), atol=ATOL, rtol=0)
