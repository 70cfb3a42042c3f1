"""A GGUF file as a stage's checkpoint: the `Checkpoint` interface over pool/gguf_meta.py, weights read lazily.

`GGUFCheckpoint` answers what `stages.model.StageModel` asks of a `Checkpoint` (`.config`, `.arch`,
`.num_layers`, `.tie_word_embeddings`, `.dtype`, `has_tensor`, `nbytes`, `fingerprint`, `tensors(names)`), with
the Hugging Face tensor names, so the model code is the same for both formats. `tensors(names)` touches only the
named tensors' bytes of the memory-mapped file: a stage reads only its layers.

Each tensor, at load:
- F32 / F16 / BF16: read as stored (BF16 as its 16-bit words), then cast to the compute dtype;
- quantized (pool.gguf_meta.QUANT_TYPES), asked for with `keep_quantized` (a 2-D weight whose format has the
  int4-plane form of stages/quant_linear.py): its `Planes`, exact, for the model to pack (kept quantized);
- any other quantized tensor: `gguf.quants.dequantize` to float32, then cast;
- `llama` attn_q / attn_k rows are un-permuted (`unpermute_rope`), undoing llama.cpp's converter;
- qwen3next's offset norms lose the converter's + 1 and its ssm_a (-exp(A_log)) becomes A_log again, in float32
  before the cast (a stored 1 + w less 1 is exact for |w| <= 1);
- one expert of a stacked MoE tensor (`ffn_*_exps`) is its slice; the stacked tensor is read and dequantized
  once per `tensors()` call, for all the experts asked for.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from pool.gguf_meta import FLOAT_TYPES, HYBRID_ARCHS, PERMUTED_ARCHS, GGUFError, GGUFModel, GGUFTensor, stored_as_offset
from stages.checkpoint import PROGRESS_MIN_BYTES, CheckpointError, _Progress, check_computable
from stages.quant_linear import Planes, planes_from_gguf

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Invert llama.cpp's `LlamaModel.permute(w, heads)`: rows `[heads, 2, half]` were stored as `[heads, half,
    2]` (pairs interleaved); give them back in the halves order the Hugging Face rope rotates."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute` (what its converter writes for llama q/k rows)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """A .gguf file read as a checkpoint (module docstring); build it with `load_gguf`."""

    def __init__(self, path: str | Path) -> None:
        try:
            self.meta = GGUFModel(path)
        except GGUFError as e:
            raise CheckpointError(str(e)) from e
        self.dir = self.meta.path  # named as Checkpoint names it, for messages
        self.config = self.meta.config
        self.arch = self.config["architectures"][0]

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def quantized(self) -> bool:
        """Whether any tensor is stored quantized."""
        return bool(self.meta.quantized_types())

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config["tie_word_embeddings"])

    @property
    def dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.meta.dtype]

    def has_tensor(self, name: str) -> bool:
        return name in self.meta.tensors

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        """Stored bytes of the named tensors (all of them by default)."""
        keys = self.meta.tensors.keys() if names is None else names
        return sum(self._info(n).nbytes for n in keys)

    def fingerprint(self) -> str:
        return self.meta.fingerprint()

    def tensors(self, names: Iterable[str], device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                label: str | None = None, keep_quantized: bool = False) -> dict[str, torch.Tensor | Planes]:
        """Load only `names` (Hugging Face names) in `dtype` (default the checkpoint's) on `device`; with
        `keep_quantized`, a quantized weight with the int4-plane form comes as its `Planes` (on the CPU)."""
        names = list(dict.fromkeys(names))
        total = self.nbytes(names)  # also refuses a missing name before anything is read
        progress = _Progress(label or str(self.dir), total) if total >= PROGRESS_MIN_BYTES else None
        dtype = dtype or self.dtype
        out: dict[str, torch.Tensor] = {}
        stacked: dict[str, torch.Tensor] = {}  # a MoE layer's stacked experts, dequantized once for all of them
        decomposed: dict[str, Planes | None] = {}  # or decomposed into planes once for all of them
        for n in names:
            planes = self._planes(n, decomposed) if keep_quantized else None
            out[n] = planes if planes is not None else self._load(n, dtype, stacked).to(device)
            if progress:
                progress.add(self._info(n).nbytes)
        if progress:
            progress.done()
        return out

    def _load(self, name: str, dtype: torch.dtype, stacked: dict[str, torch.Tensor]) -> torch.Tensor:
        info = self._info(name)
        if info.expert is None:
            t = self._read(info).reshape(info.shape)
        else:
            if info.name not in stacked:
                stacked[info.name] = self._read(info)
            t = stacked[info.name].reshape(-1, *info.shape)[info.expert]
        if self.meta.arch in PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            t = unpermute_rope(t, heads)
        if stored_as_offset(self.meta.arch, name):  # 1 + weight as stored (pool/gguf_meta.py)
            t = t.float() - 1.0
        elif self.meta.arch in HYBRID_ARCHS and name.endswith("linear_attn.A_log"):  # stored as -exp(A_log)
            t = torch.log(-t.float())
        return t.to(dtype).contiguous()

    def _planes(self, name: str, decomposed: dict[str, Planes | None]) -> Planes | None:
        """The int4 planes of a quantized 2-D weight (one expert's rows of a stacked one), or None."""
        info = self._info(name)
        if not info.quantized or len(info.shape) != 2:
            return None
        if info.name not in decomposed:  # a stacked tensor is decomposed once for all its experts
            t = self.meta.reader_tensor(info)
            rows = int(t.n_elements) // info.shape[1]
            decomposed[info.name] = planes_from_gguf(t.tensor_type.name, t.data, (rows, info.shape[1]))
        planes = decomposed[info.name]
        if planes is None:
            return None
        if info.expert is not None:
            n = info.shape[0]
            planes = planes.rows(slice(info.expert * n, (info.expert + 1) * n))
        if self.meta.arch in PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            planes = planes.rows(unpermute_rope(torch.arange(info.shape[0]), heads))
        return planes

    def _read(self, info: GGUFTensor) -> torch.Tensor:
        """A whole stored tensor as floats (dequantized), shaped as gguf shapes it."""
        import gguf

        t = self.meta.reader_tensor(info)
        kind = t.tensor_type.name
        if kind == "BF16":
            return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
        if kind in FLOAT_TYPES:
            return torch.from_numpy(np.array(t.data))
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))

    def _info(self, name: str) -> GGUFTensor:
        info = self.meta.tensors.get(name)
        if info is None:
            raise CheckpointError(f"tensor '{name}' is missing from GGUF file {self.dir}")
        return info


def load_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a .gguf file as a checkpoint; refused (CheckpointError) as `load_checkpoint` refuses a directory."""
    ckpt = GGUFCheckpoint(path)
    check_computable(ckpt.config, ckpt.dir)
    return ckpt
