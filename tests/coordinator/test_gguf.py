"""GGUF files on the coordinator side: the tokenizer (coordinator/gguf_tokenizer.py) against the checkpoint
tokenizer it was made from, and `strata config check` figures against the checkpoint's."""
from __future__ import annotations

import pytest

from coordinator.config_check import check, format_report
from coordinator.gguf_tokenizer import GGUFTokenizerError, read_vocab
from coordinator.tokenizer import Tokenizer
from pool import computable
from pool.config import ConfigError, config_from_dict
from pool.gguf_meta import GGUFModel
from tests.stages.gguf_files import write_gguf

gguf = pytest.importorskip("gguf")

TEXTS = [
    "The river ran low that summer.",
    "  two leading spaces, trailing\n\n\tand tabs  ",
    "def f(x):\n    return x + 1\n",
    "Café 東京 🙂 Straße — € ≤ ≥",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    "don't won't I'll we've 12345 3.14159",
]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "東京 café 🙂"}],
]


@pytest.fixture(scope="module")
def pair(tiny_model_factory, tmp_path_factory):
    hf = tiny_model_factory("qwen3", layers=1)
    path = write_gguf(hf, tmp_path_factory.mktemp("gguf-tok") / "tiny.gguf", "Q8_0")
    return Tokenizer.from_dir(hf), Tokenizer.from_gguf(path), path


def test_ids_and_text_match_the_checkpoint_tokenizer(pair) -> None:
    want, got, _ = pair
    assert got.vocab_size == want.vocab_size
    for text in TEXTS:
        ids = want.encode(text)
        assert got.encode(text) == ids, text
        assert got.encode(text, add_special=True) == want.encode(text, add_special=True)
        assert got.decode(ids) == want.decode(ids) == text
        assert got.decode(ids, skip_special=True) == want.decode(ids, skip_special=True)


def test_chat_template_and_special_ids_match(pair) -> None:
    want, got, path = pair
    for chat in CHATS:
        assert got.apply_chat_template(chat) == want.apply_chat_template(chat)
        assert got.chat_ids(chat) == want.chat_ids(chat)
    assert got.chat_template == want.chat_template
    assert got.special_tokens["bos_token"] == want.special_tokens["bos_token"]
    assert got.special_tokens["eos_token"] == want.special_tokens["eos_token"]
    assert got.eos_ids <= want.eos_ids and got.token_id("<|im_end|>") in got.eos_ids
    assert got.name == path.stem


def test_config_from_metadata_is_torch_free(pair) -> None:
    _, _, path = pair
    m = GGUFModel(path)
    assert m.config["architectures"] == ["Qwen3ForCausalLM"] and m.config["num_hidden_layers"] == 1
    assert m.quantized_types() == {"Q8_0": 8}  # embedding, q, k, v, o, gate, up, down
    assert m.dtype == "bfloat16"  # auto on a quantized embedding


def _with_pre(path, out, pre: str, add_bos: bool = False):
    """A copy of the GGUF file at `path` with another tokenizer.ggml.pre (and add_bos_token)."""
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(out), "qwen3")
    for f in reader.fields.values():
        if f.name.startswith(("qwen3.", "tokenizer.")) and f.name not in ("tokenizer.ggml.pre",
                                                                          "tokenizer.ggml.add_bos_token"):
            w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    w.add_tokenizer_pre(pre)
    w.add_add_bos_token(add_bos)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data.copy(), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_unknown_pre_tokenizer_is_refused(pair, tmp_path) -> None:
    with pytest.raises(GGUFTokenizerError, match="some-new-model"):
        read_vocab(_with_pre(pair[2], tmp_path / "pre.gguf", "some-new-model"))


def test_llama3_pre_tokenizer_and_bos(pair, tmp_path) -> None:
    tok = Tokenizer.from_gguf(_with_pre(pair[2], tmp_path / "llama3.gguf", "llama-bpe", add_bos=True))
    words = [w for w, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x 12345 don't")]
    assert words == ["x", "Ġ", "123", "45", "Ġdon", "'t"]  # digits in threes; the space alone before them
    bos = tok.token_id(tok.special_tokens["bos_token"])
    assert tok.encode("hi", add_special=True) == [bos, *tok.encode("hi")]
    qwen2 = Tokenizer.from_gguf(_with_pre(pair[2], tmp_path / "qwen2.gguf", "qwen2"))
    assert qwen2.encode("cafe\u0301") == qwen2.encode("caf\u00e9")  # NFC first, as its HF tokenizer


def _box(model, ranges, **engine) -> dict:
    stages = [{"layers": list(r), "endpoint": f"ipc:///tmp/gguf-cc-{i}"} for i, r in enumerate(ranges)]
    eng = {"max_context": 64, "chunk_cells": 16, "kv_pool_tokens": 160, "parallel": 2, "prefill_chunk": 16, **engine}
    return {"model": str(model), "engine": eng, "stages": stages}


def test_config_check_figures_of_gguf_files(tiny_model_factory, tmp_path, monkeypatch) -> None:
    hf = tiny_model_factory("llama", layers=4)
    f32 = write_gguf(hf, tmp_path / "f32.gguf", "F32")
    q8 = write_gguf(hf, tmp_path / "q8.gguf", "Q8_0")
    want = check(config_from_dict(_box(hf, [(0, 2), (2, 4)])))
    got = check(config_from_dict(_box(f32, [(0, 2), (2, 4)])))
    assert got.model.weights_from == "GGUF header" and got.notes == []
    assert (got.model.arch, got.model.num_layers, got.model.kv_heads, got.model.head_dim, got.model.dtype) == \
        (want.model.arch, 4, want.model.kv_heads, want.model.head_dim, "float32")
    assert [s.weight_bytes for s in got.stages] == [s.weight_bytes for s in want.stages]
    assert [s.pool_bytes for s in got.stages] == [s.pool_bytes for s in want.stages]
    # Quantized, kept quantized on CPU stages in any dtype: the figures are the stages' own weight bytes as loaded.
    q32 = check(config_from_dict(_box(q8, [(0, 2), (2, 4)], dtype="float32")))
    assert any("30 tensors as Q8_0" in n and "kept quantized: Q8_0 as bytes" in n for n in q32.notes)
    # auto: a quantized file's bfloat16, float32 on CPU stages of a CPU without native bfloat16 products
    monkeypatch.setattr(computable, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert check(config_from_dict(_box(q8, [(0, 2), (2, 4)]))).kv_dtype == "float32"
    monkeypatch.setattr(computable, "cpu_flags", lambda: frozenset({"avx2", "avx512bw", "avx512vl", "avx512dq"}))
    auto = check(config_from_dict(_box(q8, [(0, 2), (2, 4)])))
    assert auto.kv_dtype == "bfloat16"
    # a CUDA stage keeps them only in bfloat16: float32 on a box with one counts them dequantized
    cuda = _box(q8, [(0, 2), (2, 4)], dtype="float32")
    cuda["stages"][1]["device"] = "cuda:0"
    assert [s.weight_bytes for s in check(config_from_dict(cuda)).stages] == [s.weight_bytes for s in want.stages]
    assert "weights from GGUF header" in format_report(auto)


@pytest.mark.parametrize("qtype,tied", [("Q8_0", False), ("Q4_0", True), ("Q4_K", False), ("Q4_K_M", False),
                                        ("Q4_K_M", True)])
def test_config_check_weights_are_the_loaded_stages(tiny_model_factory, tmp_path, qtype: str, tied: bool) -> None:
    """The oracle is the stage itself: StageModel.weight_bytes() of each stage's layers, kept quantized, in
    float32 and bfloat16 (every row count a multiple of the CPU packer's 64-row block). Q4_K_M's Q6_K weights
    (groups of 16) are bytes on CPU stages, the output and a tied embedding among them."""
    hf = tiny_model_factory("llama", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=640,
                            tie_embeddings=tied)
    reports = checks_as_loaded(write_gguf(hf, tmp_path / f"{qtype}.gguf", qtype))
    if qtype == "Q4_K_M":
        # the output, and v and down of layers 2 and 3
        assert GGUFModel(tmp_path / f"{qtype}.gguf").quantized_types()["Q6_K"] == 1 + 2 * 2
        assert all(any("Q6_K as bytes" in n for n in r.notes) for r in reports)


def test_a_tied_q6_k_table_off_cpu_stages_counts_its_head_dequantized(tiny_model_factory, tmp_path) -> None:
    """A tied Q6_K table (a Q4_K_M file without output.weight): the embedding stays planes on any device; the head is
    bytes on a box of CPU stages, and dequantized (the compute dtype's size) where a CUDA stage is in the box."""
    from coordinator.config_check import _gguf_model
    from pool.gguf_meta import kept_bytes

    hf = tiny_model_factory("llama", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=640,
                            tie_embeddings=True)
    path = write_gguf(hf, tmp_path / "m.gguf", "Q4_K_M")
    box = _box(path, [(0, 2), (2, 4)], dtype="bfloat16")
    heads = []
    for device in ("cpu", "cuda:0"):
        box["stages"][1]["device"] = device
        tensors = _gguf_model(config_from_dict(box), [])[2]
        heads.append(next(x for x in tensors if x[0] == "lm_head.weight"))
    assert heads[0] == ("lm_head.weight", kept_bytes("Q6_K", (640, 256), 2, cpu=True), 640 * 256, False)
    assert heads[1] == ("lm_head.weight", 640 * 256 * 2, 640 * 256, True)


def checks_as_loaded(path) -> list:
    """strata config check of `path` over stages [0, 2) and [2, 4), in float32 and bfloat16: each stage's weight
    bytes equal StageModel.weight_bytes() of those layers; returns the two reports."""
    from stages.checkpoint import load_checkpoint
    from stages.model import StageModel

    ckpt, reports = load_checkpoint(path), []
    for dtype in ("float32", "bfloat16"):
        report = check(config_from_dict(_box(path, [(0, 2), (2, 4)], dtype=dtype)))
        loaded = [StageModel(ckpt, a, b, "cpu", dtype).weight_bytes() for a, b in ((0, 2), (2, 4))]
        assert [s.weight_bytes for s in report.stages] == loaded, dtype
        reports.append(report)
    return reports


def test_config_check_figures_of_a_moe_gguf(tiny_model_factory, tmp_path) -> None:
    hf = tiny_model_factory("qwen3_moe", layers=2)
    q8 = write_gguf(hf, tmp_path / "moe.gguf", "Q8_0")
    want = check(config_from_dict(_box(hf, [(0, 1), (1, 2)])))
    got = check(config_from_dict(_box(q8, [(0, 1), (1, 2)], dtype="float32")))
    assert got.model.arch == "Qwen3MoeForCausalLM"
    assert all(g.weight_bytes < 0.5 * w.weight_bytes for g, w in zip(got.stages, want.stages))  # kept quantized
    assert any("kept quantized: Q8_0" in n for n in got.notes)
    cuda = _box(q8, [(0, 1), (1, 2)], dtype="float32")  # float32 on CUDA: dequantized, the float sizes
    cuda["stages"][0]["device"] = "cuda:0"
    assert [s.weight_bytes for s in check(config_from_dict(cuda)).stages] == [s.weight_bytes for s in want.stages]
    # per layer q, k, v, o and 3 stacked experts (the router stays F32, as llama.cpp's converter keeps it); the
    # embedding and lm_head
    assert GGUFModel(q8).quantized_types() == {"Q8_0": 2 * 7 + 2}


def test_config_check_refuses_a_bad_gguf(tmp_path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match="x.gguf"):
        check(config_from_dict(_box(bad, [(0, 1)])))
    with pytest.raises(ConfigError, match="missing.gguf"):
        check(config_from_dict(_box(tmp_path / "missing.gguf", [(0, 1)])))


def test_cli_resolves_a_gguf_file(pair, tmp_path) -> None:
    from coordinator.cli import resolve_model_dir

    _, _, path = pair
    assert resolve_model_dir(config_from_dict(_box(path, [(0, 1)]))) == path
    with pytest.raises(ConfigError, match="is not a file"):
        resolve_model_dir(config_from_dict(_box(tmp_path / "none.gguf", [(0, 1)])))


@pytest.mark.parametrize("qtype", ["F32", "Q4_K"])
def test_config_check_weights_of_a_qwen3_next_gguf(tiny_model_factory, tmp_path, qtype: str) -> None:
    """qwen3next: the stages' own weight bytes (its (1 + weight) norms and decay parameters held in float32, q/k
    norms once per head) in float32 and bfloat16; 32 value heads, so the fused linear-attention rows are whole
    64-row blocks of the CPU packer. The state pool is counted beside the pool."""
    hf = tiny_model_factory("qwen3_next", layers=4, hidden=256, heads=32, kv_heads=16, intermediate=512, vocab=640)
    for report in checks_as_loaded(write_gguf(hf, tmp_path / f"{qtype}.gguf", qtype)):
        assert report.model.arch == "Qwen3NextForCausalLM"
        assert [s.pool_bytes > 0 for s in report.stages] == [False, True]  # layers 0-2 linear, layer 3 full
    assert "linear-attention state" in format_report(report)
