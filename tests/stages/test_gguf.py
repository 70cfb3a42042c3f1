"""GGUF files through the stages: the same logits as the Hugging Face checkpoint they were made from.

Oracles: an F32 file gives our stages' logits on the checkpoint (atol 1e-5) and transformers' (1e-4); a
quantized file gives transformers' logits on the dequantized weights (tests/stages/gguf_files.py, which
quantizes with the gguf package itself); a 2-stage split reads only its own tensors and agrees with one stage.
llama files carry llama.cpp's q/k row permutation, so they test the un-permute.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stages.batch import StepBatch
from stages.checkpoint import CheckpointError, load_checkpoint
from stages.gguf_weights import GGUFCheckpoint, permute_rope, unpermute_rope
from stages.kv_cache import KVCache
from stages.model import StageModel
from stages import byte_rows
from stages.byte_rows import ByteLinear
from stages.quant_linear import KERNEL_MAX_ROWS, QuantEmbedding, QuantLinear, RowStack
from tests.stages.gguf_files import write_dequantized_checkpoint, write_gguf
from tests.stages.harness import Local, make_cfg

gguf = pytest.importorskip("gguf")

CHUNK, N_CHUNKS, TABLE_CHUNKS = 16, 8, 6
PROMPT = [5, 17, 99, 3, 250, 41, 8, 77, 120, 6, 33, 2, 9, 64, 18, 200, 11, 300, 1, 47]
SHAPE = dict(layers=4, hidden=64, heads=4, kv_heads=2, seed=5)
SHAPE_K = dict(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, seed=5)  # rows of whole 256-blocks


@pytest.fixture(scope="module")
def files(tiny_model_factory, tmp_path_factory):
    """files(arch, qtype) -> (gguf path, Hugging Face dir with the same weights), built once each."""
    root = tmp_path_factory.mktemp("gguf")
    built: dict = {}

    def get(arch: str, qtype: str = "F32", shape: dict | None = None) -> tuple[Path, Path]:
        shape = shape or (SHAPE_K if "_K" in qtype else SHAPE)
        key = (arch, qtype, shape["hidden"])
        if key not in built:
            hf = tiny_model_factory(arch, **shape)
            path = write_gguf(hf, root / f"{arch}-{qtype}-{shape['hidden']}.gguf", qtype)
            if qtype != "F32":
                hf = write_dequantized_checkpoint(hf, qtype, root / f"{arch}-{qtype}-{shape['hidden']}-dequantized")
            built[key] = (path, hf)
        return built[key]

    return get


def stage_logits(model_path: Path, splits: list[int], ids: list[int] = PROMPT, dtype: torch.dtype = torch.float32,
                 keep_quantized: bool = True) -> torch.Tensor:
    """Every position's logits of one prefill through stages [0, s0), [s0, s1), ... (float32 logits)."""
    ckpt = load_checkpoint(model_path)
    bounds = [0, *splits, ckpt.num_layers]
    batch = StepBatch.from_slots([[0, 0, len(ids), 1]])
    x = torch.tensor(ids, dtype=torch.int32)
    for a, b in zip(bounds, bounds[1:]):
        m = StageModel(ckpt, a, b, "cpu", dtype, keep_quantized=keep_quantized)
        kv = KVCache(m.num_kv_layers, N_CHUNKS, CHUNK, m.kv_heads, m.head_dim, "float32", "cpu", 1, TABLE_CHUNKS)
        kv.set_table(0, [3, 1, 6, 0, 7, 2])
        x = m.forward(batch, kv, x, logits_all=True, state=m.new_state_pool(1))
    return x


def hf_logits(hf_dir: Path, ids: list[int] = PROMPT) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_permutation_inverts_llama_cpp_converter() -> None:
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_rope(permute_rope(w, 4), 4), w)
    assert not torch.equal(permute_rope(w, 4), w)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_f32_gguf_matches_checkpoint_and_transformers(files, arch: str) -> None:
    path, hf = files(arch)
    ckpt = load_checkpoint(path)
    assert isinstance(ckpt, GGUFCheckpoint)
    ours = stage_logits(path, [])
    torch.testing.assert_close(ours, stage_logits(hf, []), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours, hf_logits(hf), atol=1e-4, rtol=0)


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}])
def test_rope_scaling_from_metadata(tiny_model_factory, tmp_path, rope: dict) -> None:
    hf = tiny_model_factory("qwen3", rope_scaling=rope, max_position=64, **SHAPE)
    path = write_gguf(hf, tmp_path / "rope.gguf")
    assert load_checkpoint(path).config["rope_scaling"] == rope
    torch.testing.assert_close(stage_logits(path, []), hf_logits(hf), atol=1e-4, rtol=0)


def test_gguf_config_is_the_checkpoint_config(files) -> None:
    import json

    path, hf = files("qwen3")
    want = json.loads((hf / "config.json").read_text())
    got = load_checkpoint(path).config
    for key in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert got[key] == pytest.approx(want[key]), key
    assert load_checkpoint(files("llama")[0]).tie_word_embeddings is False


@pytest.mark.parametrize("arch,qtype", [("qwen3", "Q8_0"), ("qwen3", "Q4_0"), ("llama", "Q8_0"), ("llama", "Q4_0"),
                                        ("qwen2", "Q4_0"), ("qwen3", "Q4_K"), ("llama", "Q4_K"), ("qwen3", "F16"),
                                        ("llama", "BF16")])
def test_quantized_gguf_matches_transformers_on_dequantized_weights(files, arch: str, qtype: str) -> None:
    path, hf = files(arch, qtype)
    assert {t.type for t in load_checkpoint(path).meta.tensors.values()} == {"F32", qtype}
    torch.testing.assert_close(stage_logits(path, []), hf_logits(hf), atol=1e-4, rtol=0)


LONG_PROMPT = [(i * 37 + 5) % 300 for i in range(KERNEL_MAX_ROWS + 16)]  # the dequantize + GEMM path


@pytest.mark.parametrize("arch,qtype,ratio,spread", [("qwen3", "Q4_K", 0.36, 1.6), ("llama", "Q4_0", 0.36, 1.6),
                                                     ("qwen3", "Q8_0", 0.70, 1.6), ("qwen3_moe", "Q4_0", 0.36, 2.2)])
def test_quantized_weights_stay_quantized_in_bfloat16(files, arch: str, qtype: str, ratio: float,
                                                      spread: float) -> None:
    """Kept quantized: every projection a QuantLinear (a ByteLinear for Q8_0), the embedding a QuantEmbedding, the stage's weight bytes a
    fraction of the same model dequantized to bfloat16; logits as close to the float32 dequantized model as the
    bfloat16 dequantized model's are (measured: top-1 0.85-1.0, mean |diff| 0.96-1.41x dense, 1.39-1.85x MoE, whose
    routing turns small differences into other experts; thresholds 0.8, 1.6x / 2.2x)."""
    path, _ = files(arch, qtype, SHAPE_K)
    ckpt = load_checkpoint(path)
    kept = StageModel(ckpt, 0, ckpt.num_layers, "cpu", torch.bfloat16)
    plain = StageModel(ckpt, 0, ckpt.num_layers, "cpu", torch.bfloat16, keep_quantized=False)
    layer = kept.layers[0]
    projections = ["qkv.weight", "self_attn.o_proj.weight"]
    projections += ["experts.gate_up", "experts.down"] if "experts.gate_up" in layer else ["gate_up.weight",
                                                                                          "mlp.down_proj.weight"]
    # two planes (Q8_0) as bytes where the kernel runs (stages/byte_rows.py rule 1)
    held = ByteLinear if qtype == "Q8_0" and byte_rows.available() else QuantLinear
    for name in projections:
        w = layer[name]
        assert all(isinstance(x, held) for x in (w if isinstance(w, list) else [w])), name
    assert isinstance(kept.embed, QuantEmbedding) and isinstance(kept.lm_head, held)
    assert kept.weight_bytes() <= ratio * plain.weight_bytes()
    for ids in (PROMPT, LONG_PROMPT):
        ref = stage_logits(path, [], ids, keep_quantized=False)
        ours = stage_logits(path, [], ids, torch.bfloat16)
        bf16 = stage_logits(path, [], ids, torch.bfloat16, keep_quantized=False)
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
        assert (ours - ref).abs().mean() <= spread * (bf16 - ref).abs().mean()


def test_float32_keeps_quantized_and_matches_dequantized(files) -> None:
    """float32 takes the dequantize + GEMM path: the dequantized model's logits, on both sides of the kernel limit."""
    path, _ = files("llama", "Q4_K")
    for ids in (PROMPT, LONG_PROMPT):
        torch.testing.assert_close(stage_logits(path, [1], ids), stage_logits(path, [], ids, keep_quantized=False),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_qwen3_moe_gguf_matches_transformers(files, qtype: str) -> None:
    path, hf = files("qwen3_moe", qtype)
    ckpt = load_checkpoint(path)
    assert ckpt.config["num_experts"] == 8 and ckpt.config["num_experts_per_tok"] == 2
    assert ckpt.meta.tensors["model.layers.1.mlp.experts.5.down_proj.weight"].shape == (64, 32)
    torch.testing.assert_close(stage_logits(path, [1]), hf_logits(hf), atol=1e-4, rtol=0)


def test_split_reads_only_its_tensors_and_agrees(files, monkeypatch) -> None:
    path, _ = files("llama", "Q8_0")
    whole = stage_logits(path, [])
    read: list[str] = []
    load, planes = GGUFCheckpoint._load, GGUFCheckpoint._planes

    def spy_load(self, name, dtype, stacked):
        read.append(name)
        return load(self, name, dtype, stacked)

    def spy_planes(self, name, stacked):
        got = planes(self, name, stacked)
        if got is not None:  # kept quantized; otherwise _load reads it
            read.append(name)
        return got

    monkeypatch.setattr(GGUFCheckpoint, "_load", spy_load)
    monkeypatch.setattr(GGUFCheckpoint, "_planes", spy_planes)
    ckpt = load_checkpoint(path)
    for (a, b), extra in (((0, 2), {"model.embed_tokens.weight"}), ((2, 4), {"model.norm.weight", "lm_head.weight"})):
        read.clear()
        StageModel(ckpt, a, b, "cpu", torch.float32)
        assert {int(n.split(".")[2]) for n in read if n.startswith("model.layers.")} == set(range(a, b))
        assert {n for n in read if not n.startswith("model.layers.")} == extra
        assert len(read) == len(set(read))
    torch.testing.assert_close(stage_logits(path, [2]), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_two_stage_runners_serve_a_gguf_like_one(files, tmp_path, arch: str) -> None:
    path, _ = files(arch, "Q4_0")
    outs = []
    for i, ranges in enumerate(([[0, 4]], [[0, 2], [2, 4]])):
        local = Local(make_cfg(path, ranges, dtype="float32"), tmp_path, tag=f"g{i}")
        try:
            outs.append(local.generate(0, PROMPT, 6))
        finally:
            local.close()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("int8", [True, False])
def test_int8_activations_of_a_served_float32_stage(files, tmp_path, int8: bool) -> None:
    """engine.int8_activations (default true) reaches every byte-rows weight of a CPU stage; with it two
    conversations decoded in the same steps each get the tokens they get alone (a row is quantized by itself)."""
    from tests.stages.harness import GREEDY

    if not byte_rows.available():
        pytest.skip(f"no byte-rows kernel here: {byte_rows.unavailable_reason()}")
    path, _ = files("qwen3", "Q8_0")
    prompts = {0: PROMPT, 1: [7, 300, 41, 2, 99, 18, 5, 64, 33, 1]}
    engine = {"dtype": "float32"} if int8 else {"dtype": "float32", "int8_activations": False}
    local = Local(make_cfg(path, [[0, 2], [2, 4]], **engine), tmp_path, tag=f"i{int(int8)}")
    try:
        weights = [w for r in local.runners for w in r.model._byte_linears()]
        assert weights and all(isinstance(w, ByteLinear) and w.int8_activations == int8 for w in weights)
        solo = {s: local.generate(s, p, 5) for s, p in prompts.items()}
        slots = [[2 + s, 0, len(p), 1] for s, p in prompts.items()]
        res = local.step(slots, prompts[0] + prompts[1], {2: dict(GREEDY), 3: dict(GREEDY)})
        got = {r[0] - 2: [r[1]] for r in res}
        for i in range(5):
            step = [[2 + s, len(prompts[s]) + i, 1, 1] for s in (0, 1)]
            for r in local.step(step, [got[0][-1], got[1][-1]]):
                got[r[0] - 2].append(r[1])
    finally:
        local.close()
    assert got == solo


def test_q4_k_m_keeps_q6_k_as_bytes_and_decodes_as_transformers(files, tmp_path) -> None:
    """A Q4_K_M file (Q6_K for the output and for attn_v and ffn_down of some layers, Q4_K elsewhere): on a float32
    CPU stage its Q6_K weights are bytes in groups of 16 (stages/byte_rows.py rule 1), the fused qkv of a layer with
    a Q6_K attn_v a RowStack; the prefill's logits (dequantize + GEMM) and the greedy tokens of decode steps (the
    byte-rows kernel) are transformers' on the dequantized weights, on one stage and on two."""
    from transformers import AutoModelForCausalLM

    path, hf = files("qwen3", "Q4_K_M")
    ckpt = load_checkpoint(path)
    assert {t.type for t in ckpt.meta.tensors.values()} == {"F32", "Q4_K", "Q6_K"}
    if byte_rows.available():
        model = StageModel(ckpt, 0, ckpt.num_layers, "cpu", torch.float32)
        last = model.layers[-1]  # the last eighth of the layers: Q6_K attn_v and ffn_down
        assert isinstance(last["mlp.down_proj.weight"], ByteLinear) and last["mlp.down_proj.weight"].group == 16
        assert isinstance(last["qkv.weight"], RowStack) and last["qkv.weight"].parts[-1].group == 16
        assert isinstance(model.lm_head, ByteLinear) and model.lm_head.group == 16
        assert model.layers[0]["mlp.down_proj.weight"].group == 32  # Q4_K
        del model
    torch.testing.assert_close(stage_logits(path, []), hf_logits(hf), atol=1e-4, rtol=0)
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    want = list(PROMPT)
    with torch.no_grad():
        for _ in range(6):
            want.append(int(ref(torch.tensor([want])).logits[0, -1].argmax()))
    for i, ranges in enumerate(([[0, 2]], [[0, 1], [1, 2]])):
        local = Local(make_cfg(path, ranges, dtype="float32", int8_activations=False), tmp_path, tag=f"m{i}")
        try:
            assert local.generate(0, PROMPT, 5) == want[len(PROMPT):], ranges  # the first token, then 5 steps
        finally:
            local.close()


@pytest.mark.parametrize("int8", [True, False])
def test_a_piece_that_samples_nothing_runs_no_head_on_a_quantized_file(files, int8: bool) -> None:
    """A step of prompt pieces only (sample=0 for each) on the last stage of a Q4_K_M file, whose tied table is a
    ByteLinear on a CPU stage: no logits ([0, vocab]) and no error; the piece after it, which samples, gives the
    logits it gives after the same first piece run with a sample, bit for bit."""
    path, _ = files("qwen3", "Q4_K_M")
    ckpt = load_checkpoint(path)
    m = StageModel(ckpt, 0, ckpt.num_layers, "cpu", torch.float32, int8_activations=int8)
    ids = torch.tensor(PROMPT, dtype=torch.int32)
    kv = KVCache(m.num_kv_layers, N_CHUNKS, CHUNK, m.kv_heads, m.head_dim, "float32", "cpu", 2, 2)
    kv.set_table(0, [3, 1])
    kv.set_table(1, [6, 0])
    first = m.forward(StepBatch.from_slots([[0, 0, 12, 0]]), kv, ids[:12])
    assert first.shape == (0, m.vocab_size) and first.dtype == torch.float32
    last = m.forward(StepBatch.from_slots([[0, 12, len(PROMPT) - 12, 1]]), kv, ids[12:])
    assert m.forward(StepBatch.from_slots([[1, 0, 12, 1]]), kv, ids[:12]).shape == (1, m.vocab_size)
    want = m.forward(StepBatch.from_slots([[1, 12, len(PROMPT) - 12, 1]]), kv, ids[12:])
    assert last.shape == (1, m.vocab_size) and torch.equal(last, want)


def test_k_quant_tensor_dequantizes_as_gguf_does(files, tmp_path) -> None:
    """Q4_K (gguf cannot quantize it): a block of random bytes with sane f16 scales, read back as gguf reads it."""
    src, _ = files("qwen3")
    reader = gguf.GGUFReader(str(src))
    rng = np.random.default_rng(0)
    q4k = gguf.GGMLQuantizationType.Q4_K
    block, size = gguf.GGML_QUANT_SIZES[q4k]
    raw = rng.integers(0, 256, (8, size), dtype=np.uint8)
    raw[:, 0:4] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)  # d, dmin
    out = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(out), "qwen3")
    for f in reader.fields.values():
        if f.name.startswith("qwen3.") or f.name == "tokenizer.ggml.bos_token_id":
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":
            continue
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("blk.0.ffn_up.weight", raw.reshape(8, size), raw_dtype=q4k)  # 8 rows of 256 (one block each)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = GGUFCheckpoint(out)
    got = ckpt.tensors(["model.layers.0.mlp.up_proj.weight"])["model.layers.0.mlp.up_proj.weight"]
    assert got.shape == (8, block)
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(raw, q4k)))


def test_unsupported_tensor_is_refused(files, tmp_path) -> None:
    src, _ = files("qwen3")
    reader = gguf.GGUFReader(str(src))
    out = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(out), "qwen3")
    for f in reader.fields.values():
        if f.name.startswith("qwen3."):
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="rope_freqs"):
        load_checkpoint(out)


def test_split_gguf_is_the_whole_file(files, tiny_model_factory, tmp_path) -> None:
    """llama.cpp's gguf-split layout: named by its first file, the same model as the unsplit file; another file
    of the split, or a split with a file missing, is refused naming it."""
    path, _ = files("qwen3", "Q4_0")
    src = load_checkpoint(path)
    first = write_gguf(tiny_model_factory("qwen3", **SHAPE), tmp_path / "m.gguf", "Q4_0", split_max_tensors=10)
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert first == shards[0] and len(shards) >= 3 and first.name.endswith(f"-00001-of-{len(shards):05d}.gguf")
    split = load_checkpoint(first)
    assert split.config == src.config and split.meta.tensors.keys() == src.meta.tensors.keys()
    assert {t.shard for t in split.meta.tensors.values()} == set(range(len(shards)))
    torch.testing.assert_close(stage_logits(first, [2]), stage_logits(path, []), atol=1e-5, rtol=0)
    with pytest.raises(CheckpointError, match=f"file 2 of a {len(shards)}-file split GGUF; name its first file"):
        load_checkpoint(shards[1])
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=f"{shards[-1].name}, is missing"):
        load_checkpoint(first)


def test_concurrent_slots_match_solo_runs_kept_quantized(files, tmp_path) -> None:
    """bfloat16, weights kept quantized (Q4_K), 2 stages: two conversations prefilled and decoded in the same
    steps give each the tokens it gets alone, token for token (every step here takes the kernel path, whose
    rows are computed independently of each other)."""
    from tests.stages.harness import GREEDY

    path, _ = files("qwen3", "Q4_K")
    prompts = {0: PROMPT, 1: [7, 300, 41, 2, 99, 18, 5, 64, 33, 1]}
    local = Local(make_cfg(path, [[0, 1], [1, 2]], dtype="bfloat16"), tmp_path, tag="solo")
    try:
        solo = {s: local.generate(s, p, 6) for s, p in prompts.items()}
    finally:
        local.close()
    local = Local(make_cfg(path, [[0, 1], [1, 2]], dtype="bfloat16"), tmp_path, tag="both")
    try:
        assert isinstance(local.runners[0].model.layers[0]["qkv.weight"], QuantLinear)
        slots = [[0, 0, len(prompts[0]), 1], [1, 0, len(prompts[1]), 1]]
        res = local.step(slots, prompts[0] + prompts[1], {0: dict(GREEDY), 1: dict(GREEDY)})
        got = {r[0]: [r[1]] for r in res}
        for i in range(6):
            step = [[s, len(prompts[s]) + i, 1, 1] for s in (0, 1)]
            for r in local.step(step, [got[0][-1], got[1][-1]]):
                got[r[0]].append(r[1])
    finally:
        local.close()
    assert got == solo


# qwen3next: 4 layers (3 linear-attention, the 4th full attention), rows of whole 256-blocks for the K formats.
NEXT_K = dict(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512, seed=5)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0"])
def test_qwen3_next_gguf_matches_transformers(files, qtype: str) -> None:
    """llama.cpp's qwen3next layout read back (attn_qkv / attn_gate for in_proj_qkvz, ssm_a = -exp(A_log), norms
    stored as 1 + weight, the ssm.* geometry): transformers' logits on the (dequantized) checkpoint, over one
    stage and over splits whose first stage holds no full-attention layer."""
    import json

    path, hf = files("qwen3_next", qtype)
    want = json.loads((hf / "config.json").read_text())
    got = load_checkpoint(path).config
    for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim", "partial_rotary_factor", "shared_expert_intermediate_size",
                "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob", "head_dim"):
        assert got[key] == want[key], key
    from pool.layer_kinds import layer_types

    assert layer_types(got) == layer_types(want) == ("linear_attention",) * 3 + ("full_attention",)
    ref = hf_logits(hf)
    for splits in ([], [1], [3]):
        torch.testing.assert_close(stage_logits(path, splits), ref, atol=1e-4, rtol=0)


def test_qwen3_next_stays_quantized_in_bfloat16(files) -> None:
    """Q4_K qwen3next kept quantized: the fused linear-attention projection (q | k | v | z | b | a, reordered as
    planes), the gated attention's qkv and the experts' gate_up are QuantLinears (their down rows, 32 wide, hold
    no Q4_K block); weights under half of bfloat16; logits as close to the float32 dequantized model as the
    bfloat16 dequantized model's (measured: top-1 0.85-0.88, mean |diff| 0.67-0.94x; thresholds 0.75, 1.6x)."""
    path, _ = files("qwen3_next", "Q4_K", NEXT_K)
    ckpt = load_checkpoint(path)
    kept = StageModel(ckpt, 0, ckpt.num_layers, "cpu", torch.bfloat16)
    plain = StageModel(ckpt, 0, ckpt.num_layers, "cpu", torch.bfloat16, keep_quantized=False)
    linear, full = kept.layers[0], kept.layers[3]
    assert isinstance(linear["linear.in_proj"], QuantLinear) and isinstance(full["qkv.weight"], QuantLinear)
    assert all(isinstance(x, QuantLinear) for x in linear["experts.gate_up"] + full["experts.gate_up"])
    assert kept.weight_bytes() <= 0.45 * plain.weight_bytes()  # measured 0.43: the experts' down rows stay bfloat16
    for ids in (PROMPT, LONG_PROMPT):
        ref = stage_logits(path, [], ids, keep_quantized=False)
        ours = stage_logits(path, [2], ids, torch.bfloat16)
        bf16 = stage_logits(path, [], ids, torch.bfloat16, keep_quantized=False)
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
        assert (ours - ref).abs().mean() <= 1.6 * (bf16 - ref).abs().mean()
