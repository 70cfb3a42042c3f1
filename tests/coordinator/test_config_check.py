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


# The dual-3080 box: Qwen3-14B's config.json (no weight files: weights from the geometry).
QWEN3_14B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 40, "hidden_size": 5120,
    "intermediate_size": 17408, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}  # Qwen's long-context block
CARD = 20 * 2**30  # the 20 GiB card the YAML assumes


def _dual(tmp_path: Path, conf: dict, overrides: list[str] | None = None) -> config_check.Report:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(conf))
    return check(load_config(REPO / "configs" / "dual-3080.yaml", [f"model={model}", *(overrides or [])]))


def test_dual_3080_exact_figures(tmp_path: Path) -> None:
    report = _dual(tmp_path, QWEN3_14B)
    assert report.kv_dtype == "int8" and report.bytes_per_cell == 2 * 8 * 128 + 2 * 8 * 4 == 2112
    assert report.model.weights_from == "config.json geometry"
    layer = (2 * 5120 * 5120 + 2 * 1024 * 5120 + 3 * 17408 * 5120 + 2 * 128 + 2 * 5120) * 2
    embed = 151936 * 5120 * 2
    assert [s.weight_bytes for s in report.stages] == [20 * layer + embed, 20 * layer + 5120 * 2 + embed] \
        == [14_768_302_080, 14_768_312_320]
    frame = 4096 * 20 * 2112
    for s in report.stages:
        assert s.pool_bytes == 129 * 4096 * 20 * 2112 == 22_318_940_160      # 20.79 GiB, pinned host memory
        assert s.pinned and s.pool_cells == 524288
        assert s.baseline_bytes == 5 * 131072 * 20 * 2112 == 27_682_406_400
        assert (s.window_frames, s.window_cells, s.window_bytes) == (20, 81920, 21 * frame) == (20, 81920, 3_633_315_840)
    assert [s.scratch_bytes for s in report.stages] == [2_006_974_464, 2_006_974_464 + 4 * 151936 * 4]
    assert [s.device_bytes for s in report.stages] == [20_408_592_384, 20_411_033_600]
    assert all(s.device_bytes < CARD for s in report.stages)  # type: ignore[operator]
    # 131072 cells need Qwen's YaRN block in config.json; with it, nothing to note about the rope.
    assert any("exceeds the model's max_position_embeddings=40960" in n for n in report.notes)
    yarn = _dual(tmp_path, {**QWEN3_14B, "rope_scaling": YARN})
    assert not any("max_position_embeddings" in n for n in yarn.notes)
    text = format_report(report)
    assert "20.79" in text and "41.57" in text and "22318940160 B" in text and "20411033600 B" in text
    bf16 = _dual(tmp_path, QWEN3_14B, ["engine.kv_dtype=auto"])
    assert bf16.kv_dtype == "bfloat16" and bf16.stages[0].pool_bytes == 129 * 4096 * 20 * 4096 == 43_285_217_280


def test_dual_3080_comments_state_the_report(tmp_path: Path) -> None:
    """The YAML's arithmetic is what `strata config check` prints for Qwen3-14B, and every card holds it."""
    text = (REPO / "configs" / "dual-3080.yaml").read_text()
    assert "20 GiB = 21,474,836,480 B" in text and CARD == 21_474_836_480
    report = _dual(tmp_path, {**QWEN3_14B, "rope_scaling": YARN})
    for s in report.stages:
        for figure in (s.weight_bytes, s.window_bytes, s.scratch_bytes, s.device_bytes, s.pool_bytes):
            assert f"{figure:,} B" in text, (s.index, figure)
        assert s.device_bytes is not None and s.device_bytes < CARD
    both = sum(s.pool_bytes for s in report.stages)
    assert f"{both:,} B = 41.57 GiB" in text
    assert f"{report.bytes_per_cell:,} B" in text and f"{report.config.engine.device_cells:,}" in text
    left = CARD - max(s.device_bytes for s in report.stages)  # type: ignore[type-var]
    assert f"{left:,} B (0.99 GiB) left" in text


def test_dense_geometry_weights_match_transformers(tmp_path: Path) -> None:
    """Qwen3-14B's weights from config.json vs transformers' own module."""
    import torch
    import transformers

    report = _dual(tmp_path, QWEN3_14B)
    hf = transformers.Qwen3Config(**{k: v for k, v in QWEN3_14B.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        params = dict(transformers.Qwen3ForCausalLM(hf).named_parameters())
    size = {k: p.numel() * 2 for k, p in params.items()}  # bf16
    in_layers = lambda a, b: sum(v for k, v in size.items()  # noqa: E731
                                 if k.startswith("model.layers.") and a <= int(k.split(".")[2]) < b)
    assert report.model.weights_from == "config.json geometry"
    assert report.stages[0].weight_bytes == size["model.embed_tokens.weight"] + in_layers(0, 20)
    assert report.stages[1].weight_bytes == in_layers(20, 40) + size["model.norm.weight"] + size["lm_head.weight"]
    s0 = report.stages[0]
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    device = [n for n in report.notes if n.startswith("stage 0 on cuda:0")]
    assert device == [f"stage 0 on cuda:0: device = weights {gib(s0.weight_bytes)} + window {gib(s0.window_bytes)} "
                      f"(20 frames of 4096 cells) + scratch {gib(s0.scratch_bytes)} = {gib(s0.device_bytes)} GiB; "
                      f"pinned host pool {gib(s0.pool_bytes)} GiB (the pool file, cudaHostRegister'ed)"]


# --- the device window ------------------------------------------------------------------------------------

# The tiny checkpoint on a CUDA stage: scratch written out from pool/window_plan.py's formula, for
# hidden 64, intermediate 192, 4 heads, 2 KV heads, head_dim 16, vocab 512 and ENGINE (prefill_chunk 16,
# max_context 64, parallel 2): activations 16 x (4 x 64 + 2 x 192 + (4 + 2 x 2) x 16) x 4 B, one layer's
# context 2 x 64 x 2 x 16 x 4 B, a piece's scores 256 MiB, the last stage's logits 2 x 512 x 4 B, 512 MiB slack.
TINY_SCRATCH = 16 * (4 * 64 + 2 * 192 + 8 * 16) * 4 + 2 * 64 * 2 * 16 * 4 + (256 << 20) + (512 << 20)
TINY_LOGITS = 2 * 512 * 4
CELL = 2 * 2 * 16 * 4  # float32 K and V of one cell in one layer


def _on(tiny: Path, devices: list[str], **engine: object) -> dict:
    data = _cfg(tiny, [(0, 2), (2, 4)], **engine)
    for stage, device in zip(data["stages"], devices):
        stage["device"] = device
    return data


def test_cuda_stage_device_is_weights_window_scratch(tiny: Path) -> None:
    report = check(config_from_dict(_on(tiny, ["cuda:0", "cuda:1"], device_cells=40)))
    s0, s1 = report.stages
    # 40 cells = 3 frames of 16 cells (rounded up), + 1 trash frame, each 16 cells x 2 layers x 128 B.
    window = (3 + 1) * 16 * 2 * CELL
    assert (s0.window_frames, s0.window_cells, s0.window_bytes) == (3, 48, window) == (3, 48, 32768)
    assert s0.scratch_bytes == TINY_SCRATCH and s1.scratch_bytes == TINY_SCRATCH + TINY_LOGITS
    assert s0.device_bytes == EMBED_BYTES + 2 * LAYER_BYTES + window + TINY_SCRATCH
    assert s1.device_bytes == 2 * LAYER_BYTES + NORM_BYTES + EMBED_BYTES + window + TINY_SCRATCH + TINY_LOGITS
    # The pinned host figure is the pool file's data: 11 chunks of 16 cells in 2 layers.
    assert all(s.pinned and s.pool_bytes == 11 * 16 * 2 * CELL for s in report.stages)
    assert "note: stage 1 on cuda:1: device = weights 0.00049 + window 0.000031 (3 frames of 16 cells) + scratch " \
           "0.75 = 0.75 GiB; pinned host pool 0.000084 GiB (the pool file, cudaHostRegister'ed)" in format_report(report)
    # auto: the free memory is unknown here, so the window is the whole pool (10 frames), and a note says so.
    auto = check(config_from_dict(_on(tiny, ["cuda:0", "cuda:1"])))
    assert [s.window_frames for s in auto.stages] == [10, 10]
    assert auto.stages[0].window_bytes == 11 * 16 * 2 * CELL == auto.stages[0].pool_bytes
    assert any(n.startswith("engine.device_cells=auto: the window figures are the whole pool") for n in auto.notes)


def test_cpu_window_only_with_a_number(tiny: Path) -> None:
    default = check(config_from_dict(_cfg(tiny, [(0, 2), (2, 4)])))
    for s in default.stages:
        assert (s.window_frames, s.window_bytes, s.scratch_bytes, s.device_bytes, s.pinned) == (0, 0, None, None, False)
    numbered = check(config_from_dict(_cfg(tiny, [(0, 2), (2, 4)], device_cells=17)))
    for s in numbered.stages:  # 17 cells: 2 frames of 16, + the trash frame, in host memory
        assert (s.window_frames, s.window_cells, s.window_bytes) == (2, 32, 3 * 16 * 2 * CELL)
        assert (s.scratch_bytes, s.device_bytes, s.pinned) == (None, None, False)
    row = next(x for x in format_report(numbered).splitlines() if x.startswith("    1  cpu"))
    assert row.split()[-2:] == ["0.000023", "-"]
    # pool/pipeline.py: two CPU stages on one machine take turns; a GPU stage beside a CPU one pipelines
    assert "steps: engine.pipeline=auto (in turns: one step in flight, every decoding slot in it, each stage " \
           "computing it with all its machine's cores)" in format_report(default)
    mixed = check(config_from_dict(_on(tiny, ["cpu", "cuda:0"])))
    assert "steps: engine.pipeline=auto (pipelined: up to 2 steps in flight" in format_report(mixed)
    assert check(config_from_dict(_cfg(tiny, [(0, 2), (2, 4)], device_cells=10_000))).stages[0].window_frames == 10


def test_device_cells_zero_is_refused_on_cuda(tiny: Path) -> None:
    assert check(config_from_dict(_cfg(tiny, [(0, 2), (2, 4)], device_cells=0))).stages[0].window_frames == 0
    with pytest.raises(ConfigError, match=r"engine.device_cells=0: stage 1 on cuda:0 needs a device window") as info:
        check(config_from_dict(_on(tiny, ["cpu", "cuda:0"], device_cells=0)))
    assert info.value.key == "engine.device_cells"


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
    assert lines[header].split() == ["stage", "device", "layers", "weights", "GiB", "pool", "GiB", "pool", "cells",
                                     "window", "GiB", "device", "GiB"]
    assert lines[header + 1].split() == ["0", "cpu", "[0,", "2)", "0.000489", "0.000084", "160", "-", "-"]
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
