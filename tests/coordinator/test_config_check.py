"""coordinator/config_check.py: exact figures per stage, the layer check against the model, the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import yaml

from coordinator import config_check
from coordinator.config_check import check, format_report, main_check, read_safetensors_header
from pool.config import ConfigError, config_from_dict, load_config
from pool.memory import PoolLayout

REPO = Path(__file__).resolve().parents[2]

# The tiny_model_factory default: qwen3, 4 layers, hidden 64, 4 heads, 2 KV heads (head_dim 16),
# intermediate 192, vocab 512, tied embeddings, float32. Parameters of one layer:
#   q 64x64 + k 32x64 + v 32x64 + o 64x64 = 12288; q_norm, k_norm 16 + 16; gate, up, down 3 x 192x64 = 36864;
#   two RMSNorms 2 x 64  ->  49312 parameters = 197248 bytes.
LAYER_BYTES = 49312 * 4
EMBED_BYTES = 512 * 64 * 4
NORM_BYTES = 64 * 4
# A small pool for it: chunks of 16 cells, 10 chunks (+1 trash) = 176 cells per layer.
ENGINE = {"max_context": 64, "chunk_cells": 16, "kv_pool_tokens": 160, "parallel": 2, "prefill_chunk": 16}


def _cfg(model: str | Path, ranges: list[tuple[int, int]], **engine: object) -> dict:
    stages = [{"layers": list(r), "endpoint": f"ipc:///tmp/cc-test-{i}"} for i, r in enumerate(ranges)]
    return {"model": str(model), "engine": {**ENGINE, **engine}, "stages": stages}


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("qwen3")


def test_tiny_checkpoint_exact_figures(tiny: Path) -> None:
    report = check(config_from_dict(_cfg(tiny, [(0, 2), (2, 4)])))
    assert report.model.weights_from == "safetensors headers"
    assert (report.model.num_layers, report.model.kv_heads, report.model.head_dim) == (4, 2, 16)
    assert report.kv_dtype == "float32" and report.bytes_per_cell == 2 * 2 * 16 * 4
    s0, s1 = report.stages
    assert s0.weight_bytes == EMBED_BYTES + 2 * LAYER_BYTES == 525568
    assert s1.weight_bytes == 2 * LAYER_BYTES + NORM_BYTES + EMBED_BYTES == 525824  # tied: lm_head is the embedding
    assert s0.pool_bytes == s1.pool_bytes == 11 * 16 * 2 * 256 == 90112
    assert s0.pool_cells == 160
    assert report.baseline_cells == 3 * 64 and s0.baseline_bytes == 192 * 2 * 256
    assert report.notes == []


def test_int8_and_dtype_figures(tiny: Path) -> None:
    report = check(config_from_dict(_cfg(tiny, [(0, 1), (1, 4)], kv_dtype="int8", dtype="bfloat16")))
    # int8: K and V one byte per element, plus a float32 scale per cell per head for each.
    assert report.bytes_per_cell == 2 * 2 * 16 + 2 * 2 * 4 == 80
    assert [s.pool_bytes for s in report.stages] == [176 * 1 * 80, 176 * 3 * 80]
    # Weights in engine.dtype (bf16) rather than as stored (fp32): half.
    assert [s.weight_bytes for s in report.stages] == [(EMBED_BYTES + LAYER_BYTES) // 2,
                                                      (3 * LAYER_BYTES + NORM_BYTES + EMBED_BYTES) // 2]
    for s in report.stages:
        n = s.layers[1] - s.layers[0]
        assert s.pool_bytes == PoolLayout(n, 10, 16, 2, 16, "int8").data_nbytes


def test_weights_match_the_tensors_themselves(tiny_model_factory: Callable[..., Path]) -> None:
    """Headers vs the loaded tensors (safetensors.torch), for untied, biased and sharded checkpoints."""
    from safetensors.torch import load_file

    for arch, kw in [("llama", {}), ("qwen2", {"shards": 2}), ("mistral", {"layers": 3})]:
        model = tiny_model_factory(arch, **kw)
        n = json.loads((model / "config.json").read_text())["num_hidden_layers"]
        report = check(config_from_dict(_cfg(model, [(0, 1), (1, n)])))
        tensors: dict = {}
        for f in sorted(model.glob("*.safetensors")):
            tensors.update(load_file(f))
        size = {k: v.numel() * v.element_size() for k, v in tensors.items()}
        layer = lambda i: sum(b for k, b in size.items() if k.startswith(f"model.layers.{i}."))  # noqa: E731
        lm_head = size.get("lm_head.weight", size["model.embed_tokens.weight"])
        assert report.stages[0].weight_bytes == size["model.embed_tokens.weight"] + layer(0), arch
        assert report.stages[1].weight_bytes == sum(layer(i) for i in range(1, n)) + size["model.norm.weight"] + lm_head
        # The geometry formula (used when there are no weight files) agrees with the checkpoint's tensors.
        conf = json.loads((model / "config.json").read_text())
        assert dict(config_check.dense_tensor_shapes(conf)) == {k: tuple(v.shape) for k, v in tensors.items()}


def test_header_reader(tiny: Path) -> None:
    header = read_safetensors_header(tiny / "model.safetensors")
    t = header["model.layers.0.self_attn.k_proj.weight"]
    assert t["dtype"] == "F32" and t["shape"] == [32, 64]
    assert t["data_offsets"][1] - t["data_offsets"][0] == 32 * 64 * 4


# The dual-3080 box: Qwen3-30B-A3B attention geometry, hand-made config.json (no weight files).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "max_position_embeddings": 40960, "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def _dual(tmp_path: Path, conf: dict, overrides: list[str] | None = None) -> config_check.Report:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(conf))
    return check(load_config(REPO / "configs" / "dual-3080.yaml", [f"model={model}", *(overrides or [])]))


def test_dual_3080_exact_figures(tmp_path: Path) -> None:
    report = _dual(tmp_path, QWEN3_30B_A3B)
    assert report.kv_dtype == "int8" and report.bytes_per_cell == 2 * 4 * 128 + 2 * 4 * 4 == 1056
    for s in report.stages:
        assert s.pool_bytes == 129 * 4096 * 24 * 1056 == 13_391_364_096      # 12.47 GiB, as the YAML says
        assert s.pool_cells == 524288
        assert s.baseline_bytes == 3 * 262144 * 24 * 1056 == 19_931_332_608  # 18.56 GiB
        assert s.weight_bytes is None
    assert report.model.weights_from == "unknown"
    assert any("Qwen3MoeForCausalLM is not one stages/ loads" in n for n in report.notes)
    assert any("exceeds the model's max_position_embeddings=40960" in n for n in report.notes)
    text = format_report(report)
    assert "12.47" in text and "24.94" in text and "13391364096 B" in text
    bf16 = _dual(tmp_path, QWEN3_30B_A3B, ["engine.kv_dtype=auto"])
    assert bf16.kv_dtype == "bfloat16" and bf16.stages[0].pool_bytes == 129 * 4096 * 24 * 2048 == 25_971_130_368


def test_dense_geometry_weights_match_transformers(tmp_path: Path) -> None:
    """A dense Qwen3 of the same attention geometry: weights from config.json vs transformers' own module."""
    import torch
    import transformers

    conf = {**QWEN3_30B_A3B, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    report = _dual(tmp_path, conf)
    hf = transformers.Qwen3Config(**{k: v for k, v in conf.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        params = dict(transformers.Qwen3ForCausalLM(hf).named_parameters())
    size = {k: p.numel() * 2 for k, p in params.items()}  # bf16
    in_layers = lambda a, b: sum(v for k, v in size.items()  # noqa: E731
                                 if k.startswith("model.layers.") and a <= int(k.split(".")[2]) < b)
    assert report.model.weights_from == "config.json geometry"
    assert report.stages[0].weight_bytes == size["model.embed_tokens.weight"] + in_layers(0, 24)
    assert report.stages[1].weight_bytes == in_layers(24, 48) + size["model.norm.weight"] + size["lm_head.weight"]
    device = [n for n in report.notes if n.startswith("stage 0 on cuda:0")]
    total = (report.stages[0].weight_bytes + 13_391_364_096) / 2**30
    assert device == [f"stage 0 on cuda:0: weights + pool = {total:.2f} GiB of device memory "
                      "(the CUDA stage keeps its K/V on the device), plus activations"]


def test_layer_split_must_match_the_model(tiny: Path) -> None:
    with pytest.raises(ConfigError, match=r"stages.1.layers: .* model has 4 layers: layers 4..5 are not in the model"):
        check(config_from_dict(_cfg(tiny, [(0, 2), (2, 6)])))
    with pytest.raises(ConfigError, match=r"layer 3 is not served by any stage") as info:
        check(config_from_dict(_cfg(tiny, [(0, 1), (1, 3)])))
    assert info.value.key == "stages.1.layers"


def test_model_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no config.json") as info:
        check(config_from_dict(_cfg(tmp_path / "nothing", [(0, 4)])))
    assert info.value.key == "model"


def test_pool_geometry_the_stage_cannot_lay_out(tiny: Path) -> None:
    # int8 scales of 5 chunks x 5 cells x 2 heads x 4 B = 200 B per layer: not a multiple of 64.
    data = _cfg(tiny, [(0, 4)], kv_dtype="int8", max_context=20, chunk_cells=5, kv_pool_tokens=20, prefill_chunk=5)
    with pytest.raises(ConfigError, match="engine.chunk_cells=5: stage 0 cannot lay out its pool") as info:
        check(config_from_dict(data))
    assert info.value.key == "engine.chunk_cells"


def test_embedded_tiny_is_described_without_building(tiny_model_factory: Callable[..., Path]) -> None:
    report = check(load_config(REPO / "configs" / "cpu-tiny.yaml"))
    assert report.model.source.startswith("tiny") and report.model.weights_from == "config.json geometry"
    assert (report.model.num_layers, report.model.hidden, report.model.kv_heads, report.model.head_dim) == (4, 128, 2, 32)
    assert [s.pool_bytes for s in report.stages] == [65 * 256 * 2 * 512] * 2 == [17_039_360] * 2  # as the YAML says
    assert [s.baseline_bytes for s in report.stages] == [5 * 4096 * 2 * 512] * 2
    # The same figures as the built default, read from its safetensors headers.
    built = tiny_model_factory("qwen3", layers=4, hidden=128, heads=4, kv_heads=2, seed=0, dtype="float32")
    from_headers = check(load_config(REPO / "configs" / "cpu-tiny.yaml", [f"model={built}"]))
    assert [s.weight_bytes for s in report.stages] == [s.weight_bytes for s in from_headers.stages]


def test_tiny_fallback_when_describe_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*a: object, **kw: object) -> None:
        raise OSError("no python")

    monkeypatch.setattr(config_check.subprocess, "run", fail)
    report = check(load_config(REPO / "configs" / "cpu-tiny.yaml"))
    assert report.model.weights_from == "unknown" and all(s.weight_bytes is None for s in report.stages)
    assert report.stages[0].pool_bytes == 17_039_360
    assert "    0  cpu       [0, 2)                ?" in format_report(report)


def test_report_table_and_resolved_yaml(tiny: Path, tmp_path: Path) -> None:
    cfg = config_from_dict(_cfg(tiny, [(0, 2), (2, 4)], kv_pool_tokens=150))
    text = format_report(check(cfg))
    lines = text.splitlines()
    header = next(i for i, x in enumerate(lines) if x.lstrip().startswith("stage  device"))
    assert lines[header].split() == ["stage", "device", "layers", "weights", "GiB", "pool", "GiB", "pool", "cells"]
    assert lines[header + 1].split() == ["0", "cpu", "[0,", "2)", "0.000489", "0.000084", "160"]
    assert "note: engine.kv_pool_tokens=150 is not a multiple of engine.chunk_cells=16" in text
    resolved = text.split("# resolved config\n", 1)[1]
    (tmp_path / "resolved.yaml").write_text(resolved)
    assert load_config(tmp_path / "resolved.yaml").fingerprint() == cfg.fingerprint()
    assert yaml.safe_load(resolved)["stages"][1]["layers"] == [2, 4]


def test_main_check(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    box = tmp_path / "box.yaml"
    box.write_text(yaml.safe_dump(_cfg(tiny, [(0, 2), (2, 4)])))
    assert main_check([str(box), "--set", "engine.kv_dtype=int8"]) == 0
    out = capsys.readouterr()
    assert "KV int8, 80 B per cell per layer" in out.out and out.err == ""
    assert main_check([str(box), "--set", "stages.1.layers=[2,5]"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "layer 4 is not in the model" in out.err and str(box) in out.err
    assert main_check([str(box), "--set", "engine.parallel=many"]) == 1
    assert "engine.parallel" in capsys.readouterr().err


def test_module_cli_exit_codes(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  prefill_chunk: 99999\n")
    run = subprocess.run([sys.executable, "-m", "coordinator.config_check", str(bad)], cwd=REPO,
                         capture_output=True, text=True)
    assert run.returncode == 1 and "engine.prefill_chunk=99999 is larger than engine.max_context" in run.stderr
    run = subprocess.run([sys.executable, "-m", "coordinator.config_check", "configs/cpu-tiny.yaml"], cwd=REPO,
                         capture_output=True, text=True)
    assert run.returncode == 0 and "# resolved config" in run.stdout
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", "import sys, coordinator.config_check; print(sorted(sys.modules))"], cwd=REPO,
        capture_output=True, text=True, check=True).stdout
