"""Configs the stages cannot compute are refused, naming what, by the stage at load and by `strata config check`
(the same rules on both sides), instead of being served with wrong output."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from coordinator import config_check
from pool.config import ConfigError, config_from_dict
from stages import checkpoint, rope
from stages.checkpoint import CheckpointError, check_computable, load_checkpoint
from stages.model import StageModel
from stages.tiny import make_tiny_model, tiny_config

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8_PER_TENSOR = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}  # no weight_block_size
# name -> (changes to a valid Qwen3 config.json, what the message must name)
REFUSED = {
    "gpt-oss": ({"architectures": ["GptOssForCausalLM"]}, "GptOssForCausalLM"),
    "deepseek-v3": ({"architectures": ["DeepseekV3ForCausalLM"]}, "DeepseekV3ForCausalLM"),
    "no-architectures": ({"architectures": []}, "None"),
    "gelu": ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
    "longrope": ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
                 "rope_type 'longrope'"),
    "legacy-su": ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_type 'su'"),
    "mrope-parameters": ({"rope_scaling": None, "rope_parameters": {"rope_type": "mrope", "rope_theta": 1e6}},
                         "rope_type 'mrope'"),
    "partial-rotary": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    "linear-without-factor": ({"rope_scaling": {"rope_type": "linear"}}, "needs a 'factor'"),
    "fp8-per-tensor": ({"quantization_config": FP8_PER_TENSOR},
                       "quantization_config quant_method=fp8 (fmt=e4m3, no weight_block_size) is not computed by the stages"),
    "fp8-e5m2": ({"quantization_config": {**FP8, "fmt": "e5m2"}}, "quant_method=fp8"),
    "gptq-3bit": ({"quantization_config": {"quant_method": "gptq", "bits": 3}}, "quant_method=gptq (bits=3)"),
    "awq-gemv": ({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}},
                 "quant_method=awq (bits=4, version=gemv)"),
    "bitsandbytes": ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
                     "quant_method=bitsandbytes"),
}
ACCEPTED = {
    "qwen3": {},
    "qwen3_moe": tiny_config("qwen3_moe", layers=2),
    "qwen2_moe": tiny_config("qwen2_moe", layers=2),
    "qwen3_next": tiny_config("qwen3_next", layers=2),
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    "legacy-linear": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "rope-parameters": {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "fp8-blocks": {"quantization_config": FP8},  # tests/stages/test_fp8.py computes it
    "gptq": {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}},  # test_int4_checkpoint
    "awq": {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}},
}


def _config(changes: dict) -> dict:
    return {**tiny_config("qwen3", layers=2), **changes}


def _write(d: Path, conf: dict) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(conf))
    return d


def _check(model_dir: Path, layers: int = 2):
    data = {"model": str(model_dir), "engine": {"max_context": 64, "chunk_cells": 16, "kv_pool_tokens": 64,
                                                "parallel": 2, "prefill_chunk": 16},
            "stages": [{"layers": [0, layers], "endpoint": "ipc:///tmp/refusal-test-0"}]}
    return config_check.check(config_from_dict(data))


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_stage_refuses_at_load_naming_it(tmp_path, case):
    changes, named = REFUSED[case]
    d = _write(tmp_path / case, _config(changes))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d)
    assert named in str(e.value) and "config.json" in str(e.value)


@pytest.mark.parametrize("case", list(REFUSED))
def test_config_check_refuses_naming_it(tmp_path, case):
    changes, named = REFUSED[case]
    d = _write(tmp_path / case, _config(changes))
    with pytest.raises(ConfigError) as e:
        _check(d)
    assert e.value.key == "model" and named in str(e.value) and str(d) in str(e.value)


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    d = _write(tmp_path / "m", _config({"architectures": ["GptOssForCausalLM"]}))
    with pytest.raises(ConfigError) as e:
        _check(d)
    assert all(a in str(e.value) for a in checkpoint.SUPPORTED_ARCHS)


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_both_sides_accept_what_the_stages_compute(case):
    conf = _config(ACCEPTED[case])
    check_computable(conf)
    config_check.refuse_uncomputable("config.json", conf)


def test_both_sides_hold_the_same_lists():
    assert config_check.SUPPORTED_ARCHS == checkpoint.SUPPORTED_ARCHS
    assert config_check.SUPPORTED_ROPE_TYPES == rope.SUPPORTED_ROPE_TYPES
    assert config_check.LOADABLE_ST == checkpoint.FLOAT_ST_DTYPES


def test_fp8_weights_without_a_quantization_config_are_refused_on_both_sides(tmp_path):
    d = make_tiny_model(tmp_path / "m", arch="qwen3", layers=2, hidden=64, heads=4, kv_heads=2)
    weights = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, str(d / "model.safetensors"))
    ckpt = load_checkpoint(d)
    StageModel(ckpt, 0, 1)  # layer 0 holds no such tensor
    with pytest.raises(CheckpointError, match=rf"{name}.*F8_E4M3"):
        StageModel(ckpt, 1, 2)
    with pytest.raises(ConfigError, match=rf"{name} is stored as F8_E4M3") as e:
        _check(d)
    assert e.value.key == "model"


def test_strata_config_check_exits_1_with_the_fp8_message(tmp_path, capsys):
    d = _write(tmp_path / "fp8", _config({"quantization_config": FP8_PER_TENSOR}))
    box = tmp_path / "box.yaml"
    box.write_text(yaml.safe_dump({"model": str(d), "engine": {"max_context": 64, "chunk_cells": 16,
                                                               "prefill_chunk": 16},
                                   "stages": [{"layers": [0, 2], "endpoint": "ipc:///tmp/refusal-test-0"}]}))
    assert config_check.main_check([str(box)]) == 1
    err = capsys.readouterr().err
    assert "model: quantization_config quant_method=fp8 (fmt=e4m3, no weight_block_size) is not computed" in err
