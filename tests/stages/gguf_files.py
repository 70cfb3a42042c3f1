"""Tiny GGUF files for the tests: `write_gguf` (stages/gguf_write.py, llama.cpp's converter's layout) and the
checkpoint a quantized file stands for.

`write_dequantized_checkpoint(model_dir, qtype, out)` writes the Hugging Face checkpoint whose weights are the
quantized ones dequantized (`gguf.quants.dequantize`): what transformers must compute for a quantized file.
Quantization blocks run along a row, so permuting or regrouping rows before or after quantizing gives the same
bytes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from stages.gguf_quantize import quantizable, quantize, tensor_type
from stages.gguf_write import float_weights, write_gguf  # noqa: F401  (write_gguf: the tests' writer)


def _roundtrip(w: np.ndarray, qtype: str) -> np.ndarray:
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.dequantize(quantize(w, qtype), t)


def write_dequantized_checkpoint(model_dir: str | Path, qtype: str, out: str | Path) -> Path:
    from safetensors.numpy import save_file

    model_dir, out = Path(model_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((model_dir / "config.json").read_text())
    weights = float_weights(model_dir)
    for k, v in weights.items():
        kind = tensor_type(k, qtype, cfg["num_hidden_layers"], bool(cfg.get("tie_word_embeddings")))
        weights[k] = np.ascontiguousarray(_roundtrip(v, kind) if quantizable(k, v, kind) else v)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
