"""pool/computable.auto_dtype: `engine.dtype: auto` is the checkpoint's dtype, except float32 for a box of CPU stages
on a CPU without native 16-bit products; the stage and `strata config check` resolve it alike."""
from __future__ import annotations

import pytest
import torch

from coordinator.config_check import check
from pool import computable
from pool.computable import auto_dtype
from pool.config import config_from_dict

AVX2 = frozenset({"avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize("stored, devices, flags, want", [
    ("bfloat16", ["cpu", "cpu"], AVX2, "float32"),  # torch would convert every product through float32
    ("bfloat16", ["cpu"], AVX512, "bfloat16"),
    ("bfloat16", ["cpu"], AVX2 | {"avx_ne_convert"}, "bfloat16"),
    ("bfloat16", ["cpu"], AVX2 | {"amx_bf16"}, "bfloat16"),
    ("bfloat16", ["cpu", "cuda"], AVX2, "bfloat16"),  # a GPU stage: the checkpoint's dtype for the box
    ("bfloat16", ["cuda", "cuda"], AVX2, "bfloat16"),
    ("float16", ["cpu"], AVX512, "float32"),  # AVX-512 without FP16
    ("float16", ["cpu"], AVX512 | {"avx512_fp16"}, "float16"),
    ("float32", ["cpu"], AVX2, "float32"),
])
def test_auto_is_the_checkpoints_dtype_unless_the_cpu_would_convert_it(stored, devices, flags, want):
    assert auto_dtype(stored, devices, flags) == want


def test_the_flags_agree_with_torch_on_this_cpu():
    """NATIVE_16BIT_FLAGS asks what torch's own check asks."""
    assert (auto_dtype("bfloat16", ["cpu"]) == "bfloat16") == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (auto_dtype("float16", ["cpu"]) == "float16") == torch.ops.mkldnn._is_mkldnn_fp16_supported()


@pytest.mark.parametrize("flags, want", [(AVX2, torch.float32), (AVX512, torch.bfloat16)])
def test_a_stage_and_config_check_resolve_auto_alike(tiny_model_factory, tmp_path, monkeypatch, flags, want):
    """The oracle is the stage itself: a bfloat16 checkpoint on a CPU box computes, and keeps its K/V, in the dtype
    the config check reports, and holds the weights it counts."""
    from stages.runner import StageRunner

    model = tiny_model_factory("qwen3", layers=2, dtype="bfloat16")
    monkeypatch.setattr(computable, "cpu_flags", lambda: flags)
    cfg = config_from_dict({"model": str(model), "engine": {"max_context": 64, "parallel": 2, "chunk_cells": 16,
                                                            "prefill_chunk": 16, "kv_pool_tokens": 96, "threads": 1},
                            "stages": [{"device": "cpu", "layers": [0, 2], "endpoint": "ipc:///tmp/strata-auto-0"}]})
    report = check(cfg)
    assert any("engine.dtype=auto computes in float32" in n for n in report.notes) == (want == torch.float32)
    runner = StageRunner(cfg, 0, pool_path=tmp_path / "pool0")
    try:
        assert runner.dtype == want and runner.kv_dtype == report.kv_dtype == str(want).removeprefix("torch.")
        assert report.stages[0].weight_bytes == runner.model.weight_bytes()
    finally:
        runner.close(unlink=True)
