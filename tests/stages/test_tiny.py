"""The tiny checkpoint maker, with transformers as the oracle of the Hugging Face layout."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from stages import tiny

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
ROOT = Path(__file__).resolve().parents[2]


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def _file_tensors(d: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                t = sf.get_tensor(k)
                out[k] = (tuple(t.shape), t.dtype)
    return out


def _load_hf(d: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(d), output_loading_info=True)
    return model.eval(), info


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_arch_without_missing_or_unexpected_keys(tiny_model_factory, arch):
    d = tiny_model_factory(arch, layers=2, hidden=64, heads=4, kv_heads=2)
    model, info = _load_hf(d)
    assert type(model).__name__ == tiny.ARCHS[arch]["cls"]
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(kind), (kind, info[kind])
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert cfg.vocab_size == tiny.TOKENIZER_VOCAB == 512
    names = _file_tensors(d)
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (arch == "qwen3")
    assert ("lm_head.weight" in names) == (arch in ("llama", "mistral"))
    # Every tensor transformers holds came from the files (tied lm_head aside), value for value.
    state = model.state_dict()
    with safe_open(str(d / "model.safetensors"), framework="pt") as sf:
        for k in sf.keys():
            torch.testing.assert_close(state[k], sf.get_tensor(k), rtol=0, atol=0)
    if cfg.tie_word_embeddings:
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 17, 300, 42, 7, 99]])).logits
    assert torch.isfinite(logits).all()
    assert logits.std().item() > 0.3  # WEIGHT_STD = 0.1 keeps logits far from flat


def test_norm_weights_are_perturbed_around_one(tiny_model_factory):
    d = tiny_model_factory("qwen3", layers=1)
    with safe_open(str(d / "model.safetensors"), framework="pt") as sf:
        norms = [sf.get_tensor(k) for k in sf.keys() if k.endswith("norm.weight")]
        emb = sf.get_tensor("model.embed_tokens.weight")
    assert len(norms) == 1 * 4 + 1  # input, post-attention, q, k per layer + final
    for n in norms:
        assert abs(n.mean().item() - 1.0) < 0.1 and n.std().item() > 0.03
    assert abs(emb.std().item() - tiny.WEIGHT_STD) < 0.01


def test_sharded_checkpoint_loads_and_equals_the_single_file(tiny_model_factory):
    one = tiny_model_factory("llama", layers=3, seed=4)
    three = tiny_model_factory("llama", layers=3, seed=4, shards=3)
    files = sorted(p.name for p in three.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((three / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert set(index["weight_map"]) == set(_file_tensors(one))
    assert index["metadata"]["total_size"] == (one / "model.safetensors").stat().st_size - _header_len(one)
    m1, _ = _load_hf(one)
    m3, info = _load_hf(three)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    x = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(m1(x).logits, m3(x).logits)


def _header_len(d: Path) -> int:
    raw = (d / "model.safetensors").read_bytes()
    return 8 + int.from_bytes(raw[:8], "little")


def test_same_seed_gives_byte_identical_files_across_processes(tmp_path):
    a = tiny.make_tiny_model(tmp_path / "a", arch="qwen2", layers=2, seed=7, shards=2)
    cmd = [sys.executable, "-m", "stages.tiny", str(tmp_path / "b"), "--arch", "qwen2", "--layers", "2",
           "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--seed", "7", "--shards", "2"]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    assert _hashes(a) == _hashes(tmp_path / "b")
    c = tiny.make_tiny_model(tmp_path / "c", arch="qwen2", layers=2, seed=8, shards=2)
    ha, hc = _hashes(a), _hashes(c)
    assert ha["tokenizer.json"] == hc["tokenizer.json"]
    assert ha["model-00001-of-00002.safetensors"] != hc["model-00001-of-00002.safetensors"]


def test_bfloat16_padded_vocab_and_rope_scaling(tmp_path):
    d = tiny.make_tiny_model(tmp_path, arch="llama", layers=1, dtype="bfloat16", vocab=640,
                             rope_scaling={"rope_type": "linear", "factor": 2.0}, max_position=4096)
    tensors = _file_tensors(d)
    assert tensors["model.embed_tokens.weight"] == ((640, 64), torch.bfloat16)
    assert tensors["lm_head.weight"] == ((640, 64), torch.bfloat16)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["max_position_embeddings"] == 4096
    model, info = _load_hf(d)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    rope = getattr(model.config, "rope_parameters", None) or model.config.rope_scaling
    assert rope["rope_type"] == "linear" and rope["factor"] == 2.0


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        tiny.make_tiny_model(tmp_path, vocab=100)
    with pytest.raises(ValueError, match="unknown arch"):
        tiny.make_tiny_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="hidden must divide"):
        tiny.make_tiny_model(tmp_path, hidden=60, heads=8)
    with pytest.raises(ValueError, match="unknown tiny spec keys"):
        tiny.resolve_spec({"arch": "qwen3", "layer": 2})
    with pytest.raises(ValueError, match="not a tiny model name"):
        tiny.resolve_spec("small")


def test_shard_plan_is_contiguous_balanced_and_never_empty():
    assert tiny._shard_plan([10, 10, 10, 10], 2) == [0, 0, 1, 1]
    assert tiny._shard_plan([1000, 1, 1, 1], 3) == [0, 1, 2, 2]
    assert tiny._shard_plan([1, 1, 1], 3) == [0, 1, 2]
    with pytest.raises(ValueError):
        tiny._shard_plan([1, 1], 3)


def test_ensure_tiny_builds_the_default_once_and_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    assert tiny.tiny_cache_dir() == tmp_path / "cache"
    d = tiny.ensure_tiny("tiny")
    assert d.parent == tmp_path / "cache"
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["torch_dtype"]) == ("qwen3", 4, 128, 4, 2, 32, "float32")
    stamp = os.stat(d / "model.safetensors").st_mtime_ns
    assert tiny.ensure_tiny("tiny") == d
    assert os.stat(d / "model.safetensors").st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [d.name]  # no temp dir left behind
    other = tiny.ensure_tiny("tiny:arch=llama,layers=2")
    assert other != d and json.loads((other / "config.json").read_text())["num_hidden_layers"] == 2


def test_describe_prints_the_default_config_without_building():
    out = subprocess.run([sys.executable, "-m", "stages.tiny", "--describe", "tiny"], check=True, cwd=ROOT,
                         capture_output=True, text=True).stdout
    assert json.loads(out) == tiny.tiny_config(**{k: v for k, v in tiny.DEFAULT_SPEC.items() if k != "seed"})


def test_cache_key_covers_every_file_that_shapes_the_checkpoint():
    # A tiny*.py file left out of the key would let ensure_tiny serve a build made from its old text.
    assert sorted(p.resolve() for p in tiny._SOURCES) == sorted((ROOT / "stages").glob("tiny*.py"))
    assert any(tiny.CORPUS[0] in p.read_text(encoding="utf-8") for p in tiny._SOURCES)
