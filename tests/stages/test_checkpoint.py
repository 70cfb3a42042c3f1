"""Checkpoint loading: single file and shards as written by transformers, fingerprint, errors, progress."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import stages.checkpoint as checkpoint_mod
from stages.checkpoint import SUPPORTED_ARCHS, CheckpointError, load_checkpoint
from stages.model import StageModel

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)


def save_llama(path, seed: int, shard_size: str | None = None, dtype=torch.float32, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, **kw})).to(dtype)
    extra = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **extra)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two random checkpoints of one shape (seeds 0, 1) and seed 0 again, sharded."""
    root = tmp_path_factory.mktemp("ckpt")
    model = save_llama(root / "a", 0)
    save_llama(root / "b", 1)
    save_llama(root / "a-sharded", 0, shard_size="60KB")
    return root, model


def test_reads_config_arch_and_layers(saved):
    root, _ = saved
    ckpt = load_checkpoint(root / "a")
    assert ckpt.arch == "LlamaForCausalLM" and ckpt.num_layers == 4
    assert ckpt.config["hidden_size"] == 64 and ckpt.dir == root / "a"
    assert ckpt.dtype == torch.float32 and not ckpt.tie_word_embeddings


def test_tensors_match_the_saved_model_single_and_sharded(saved):
    root, model = saved
    assert (root / "a-sharded" / "model.safetensors.index.json").is_file()
    assert len(list((root / "a-sharded").glob("*.safetensors"))) > 3
    state = model.state_dict()
    names = ["model.embed_tokens.weight", "model.layers.2.mlp.up_proj.weight", "lm_head.weight"]
    for d in ("a", "a-sharded"):
        got = load_checkpoint(root / d).tensors(names)
        assert list(got) == names
        for n in names:
            assert torch.equal(got[n], state[n]), (d, n)


def test_tensors_cast_to_the_requested_dtype(saved):
    root, model = saved
    got = load_checkpoint(root / "a").tensors(["model.norm.weight"], "cpu", torch.bfloat16)
    assert got["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.norm.weight"], model.state_dict()["model.norm.weight"].to(torch.bfloat16))


def test_missing_tensor_names_the_tensor_and_the_checkpoint(saved):
    root, _ = saved
    for d in ("a", "a-sharded"):
        ckpt = load_checkpoint(root / d)
        with pytest.raises(CheckpointError) as e:
            ckpt.tensors(["model.norm.weight", "model.layers.9.mlp.up_proj.weight"])
        assert "model.layers.9.mlp.up_proj.weight" in str(e.value) and str(root / d) in str(e.value)


def test_stage_model_on_a_checkpoint_without_a_layer_tensor_names_it(tmp_path):
    """A truncated checkpoint (a tensor dropped from the file) fails at load, naming the tensor."""
    from safetensors.torch import load_file, save_file

    save_llama(tmp_path, 0)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    ckpt = load_checkpoint(tmp_path)
    StageModel(ckpt, 2, 4)  # layers that are all there load
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        StageModel(ckpt, 0, 2)


def test_unknown_architecture_is_named_with_the_supported_list(saved, tmp_path):
    root, _ = saved
    shutil.copytree(root / "a", tmp_path / "x")
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "x" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "x")
    msg = str(e.value)
    assert "GPTNeoXForCausalLM" in msg and all(a in msg for a in SUPPORTED_ARCHS)


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(tmp_path)


def test_fingerprint_is_stable_and_tells_checkpoints_apart(saved, tmp_path):
    root, _ = saved
    a = load_checkpoint(root / "a").fingerprint()
    assert a == load_checkpoint(root / "a").fingerprint() and len(a) == 64
    assert load_checkpoint(root / "b").fingerprint() != a  # same shapes and config, other random weights
    assert load_checkpoint(root / "a-sharded").fingerprint() != a  # other files, other offsets
    shutil.copytree(root / "a", tmp_path / "c")
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(tmp_path / "c").fingerprint() != a


def test_fingerprint_reads_only_a_sample_of_each_tensor(saved, monkeypatch, tmp_path):
    """A weight changed past its sampled first bytes keeps the fingerprint: it never hashes whole tensors."""
    root, _ = saved
    monkeypatch.setattr(checkpoint_mod, "FINGERPRINT_SAMPLE_BYTES", 4)
    ckpt = load_checkpoint(root / "a")
    info = ckpt.infos["model.layers.0.mlp.down_proj.weight"]
    original = (root / "a" / "model.safetensors").read_bytes()
    for name, byte in (("far", 100), ("near", 1)):
        shutil.copytree(root / "a", tmp_path / name)
        data = bytearray(original)
        data[info.data_start + byte] ^= 0xFF
        (tmp_path / name / "model.safetensors").write_bytes(bytes(data))
    assert load_checkpoint(tmp_path / "far").fingerprint() == ckpt.fingerprint()
    assert load_checkpoint(tmp_path / "near").fingerprint() != ckpt.fingerprint()


def test_tied_embeddings(tmp_path):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, tie_word_embeddings=True))
    model.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.tie_word_embeddings and not ckpt.has_tensor("lm_head.weight")
    last = StageModel(ckpt, 2, 4, pack_weights=False)  # the last stage alone loads the embedding as its lm_head
    assert torch.equal(last.lm_head, model.state_dict()["model.embed_tokens.weight"])
    whole = StageModel(ckpt, 0, 4, pack_weights=False)
    assert whole.lm_head is whole.embed  # one table for both (packed: stages/packed_linear.py rule 9)


def test_dtype_comes_from_the_checkpoint(tmp_path):
    save_llama(tmp_path, 0, dtype=torch.bfloat16)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.dtype == torch.bfloat16
    m = StageModel(ckpt, 0, 2)
    assert m.dtype == torch.bfloat16 and m.embed.dtype == torch.bfloat16
    assert StageModel(ckpt, 0, 2, dtype="float32").embed.dtype == torch.float32
    with pytest.raises(ValueError, match="float64"):
        StageModel(ckpt, 0, 2, dtype="float64")
    with pytest.raises(ValueError, match="layer range"):
        StageModel(ckpt, 2, 5)


def test_progress_is_silent_for_small_loads_and_shown_for_large(saved, monkeypatch, capsys):
    root, _ = saved
    ckpt = load_checkpoint(root / "a-sharded")
    names = [n for n in ckpt.infos if n.startswith("model.layers.")]
    ckpt.tensors(names, label="layers 0-3")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(checkpoint_mod, "PROGRESS_MIN_BYTES", 1)
    monkeypatch.setattr(checkpoint_mod, "PROGRESS_EVERY_S", 0.0)
    ckpt.tensors(names, label="layers 0-3")
    err = capsys.readouterr().err
    total = ckpt.nbytes(names) / 1024**3
    assert f"loading layers 0-3: {total:.1f}/{total:.1f} GiB" in err
    assert err.count("loading layers 0-3") > 2 and err.endswith("\n")
