"""Rope against transformers' own rope init functions and rotary embedding (the oracle)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from stages.rope import Rope, RopeError, apply_rope, rope_init, rope_parameters

VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "llama3-short": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                     "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
                              "attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "mscale": 1.0, "mscale_all_dim": 0.707},
    "yarn-no-truncate": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                         "truncate": False},
    "yarn-implicit-factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def hf_config(rope: dict | None, head_dim: int = 64, theta: float = 500000.0, max_pos: int = 16384) -> LlamaConfig:
    params = {"rope_type": "default", "rope_theta": theta} if rope is None else {**rope, "rope_theta": theta}
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=max_pos, rope_parameters=params)


def hf_init(config: LlamaConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("name", [None, *VARIANTS])
def test_inv_freq_and_scaling_match_transformers(name, head_dim):
    config = hf_config(VARIANTS.get(name), head_dim=head_dim)
    ours = Rope(config.to_dict(), head_dim)
    want, want_scaling = hf_init(config)
    torch.testing.assert_close(ours.inv_freq, want, atol=0, rtol=0)
    assert ours.attention_scaling == pytest.approx(want_scaling, rel=1e-12)


def test_variants_really_differ_from_default():
    """Guards the test above: every scaled variant changes inv_freq or the attention scaling."""
    base = Rope(hf_config(None).to_dict(), 64)
    for name, rope in VARIANTS.items():
        if name == "dynamic":
            continue  # equals default up to max_position_embeddings, tested below
        r = Rope(hf_config(rope).to_dict(), 64)
        assert not torch.equal(r.inv_freq, base.inv_freq) or r.attention_scaling != 1.0, name


@pytest.mark.parametrize("seq_len", [None, 100, 16384, 20000, 100000])
def test_dynamic_at_sequence_lengths_matches_transformers(seq_len):
    config = hf_config(VARIANTS["dynamic"])
    params = rope_parameters(config.to_dict())
    ours, _ = rope_init(params, 64, config.max_position_embeddings, seq_len=seq_len)
    want, _ = hf_init(config, seq_len)
    torch.testing.assert_close(ours, want, atol=0, rtol=1e-6)


def test_dynamic_per_token_uses_each_tokens_context():
    config = hf_config(VARIANTS["dynamic"], max_pos=64)
    rope = Rope(config.to_dict(), 64)
    positions = torch.tensor([3, 40, 99, 10])
    contexts = torch.tensor([50, 50, 100, 300])
    cos, sin = rope.cos_sin(positions, torch.float32, contexts)
    for t in range(4):
        inv, _ = hf_init(config, int(contexts[t]))
        freqs = positions[t].float() * inv
        emb = torch.cat((freqs, freqs))
        torch.testing.assert_close(cos[t], emb.cos(), atol=1e-5, rtol=0)
        torch.testing.assert_close(sin[t], emb.sin(), atol=1e-5, rtol=0)
    plain = Rope(hf_config(None, max_pos=64).to_dict(), 64)
    torch.testing.assert_close(cos[:2], plain.cos_sin(positions[:2], torch.float32)[0])  # within max_pos: default


LEGACY = {
    "default": ({"rope_theta": 1e6, "rope_scaling": None}, {"rope_type": "default"}),
    "linear-type-key": ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
                        {"rope_type": "linear", "factor": 2.0}),
    "yarn-type-key": ({"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 4096}},
                      {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}),
    "llama3-no-original": ({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
                           {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
}


@pytest.mark.parametrize("name", list(LEGACY))
def test_legacy_config_layout_reads_like_transformers(name):
    """Older config.json files: top-level rope_theta, rope_scaling with `type` or `rope_type`."""
    legacy, rope = LEGACY[name]
    config = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 16384, **legacy}
    theta = legacy["rope_theta"]
    want, want_scaling = hf_init(hf_config(rope, theta=theta))
    ours = Rope(config, 64)
    torch.testing.assert_close(ours.inv_freq, want, atol=0, rtol=0)
    assert ours.attention_scaling == pytest.approx(want_scaling)
    assert ours.params["rope_theta"] == theta


@pytest.mark.parametrize("name", [None, "linear", "yarn", "llama3-short"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_at_arbitrary_positions_match_rotary_embedding(name, dtype):
    config = hf_config(VARIANTS.get(name), head_dim=32)
    positions = torch.tensor([5, 0, 300, 17, 17, 4095, 1, 12000])
    want_cos, want_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=dtype), positions[None])
    cos, sin = Rope(config.to_dict(), 32).cos_sin(positions, dtype)
    assert cos.dtype == dtype
    torch.testing.assert_close(cos, want_cos[0], atol=0, rtol=0)
    torch.testing.assert_close(sin, want_sin[0], atol=0, rtol=0)


def test_apply_rope_matches_transformers():
    config = hf_config(None, head_dim=32)
    positions = torch.tensor([7, 3, 250, 1000])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 6, 32, generator=g), torch.randn(4, 2, 32, generator=g)
    cos, sin = Rope(config.to_dict(), 32).cos_sin(positions, torch.float32)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(apply_rope(q, cos, sin), want_q[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), want_k[0].transpose(0, 1), atol=0, rtol=0)
    assert not torch.allclose(apply_rope(q, cos, sin), q)


@pytest.mark.parametrize("config, words", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, ["longrope", "supported: default"]),
    ({"rope_scaling": {"type": "mrope"}}, ["mrope"]),
    ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor"]),
    ({"rope_scaling": {"rope_type": "linear"}}, ["linear", "factor"]),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, ["per layer type"]),
])
def test_unsupported_rope_configs_are_refused_by_name(config, words):
    with pytest.raises(RopeError) as e:
        rope_parameters({"max_position_embeddings": 4096, **config})
    for w in words:
        assert w in str(e.value)
