"""A Hugging Face checkpoint directory, read lazily: config, safetensors headers, and only the tensors asked for.

A stage holds a layer range, so it must never read the whole checkpoint: `Checkpoint.tensors(names)` opens the
safetensors files with `safe_open` and reads only the named tensors. Two layouts are accepted, as written by
`save_pretrained`: a single `model.safetensors`, or shards listed by `model.safetensors.index.json`.

The fingerprint is what stages compare in the handshake ("do we serve the same checkpoint?"). Hashing every
byte of a 30 GiB checkpoint at each start would take minutes, so it covers `config.json`, every tensor's header
entry (name, dtype, shape, byte offsets) and a sample of each tensor's data (its first 64 bytes): two random
checkpoints of the same shape differ, and reading it costs one small read per tensor.

Refused at load, with a message naming what (`check_computable`), because the stages would otherwise serve
wrong output without a word: an architecture outside `SUPPORTED_ARCHS`, a `hidden_act` other than silu, a
rope the stages do not compute (stages/rope.py), and any `quantization_config` but block-scaled FP8 and the
GPTQ / AWQ schemes of stages/int4_checkpoint.py (whose packed `*.qweight` / `qzeros` / `scales` / `g_idx`
answer for the projection's `*.weight`: Planes with `keep_quantized`, else the dequantized weight). A tensor
stored in a dtype the stages do not cast from (FP8 without its scales, integers) is refused when it is loaded.
`strata config check` refuses the same configs before anything starts.

Block-scaled FP8 (pool/computable.fp8_blocks; DeepSeek-V3 / Qwen3 FP8 releases): a `*.weight` stored F8_E4M3
beside its float32 `*.weight_scale_inv` `[ceil(N / bn), ceil(K / bk)]` is the weight `w[i, j] * scale[i // bn,
j // bk]` (`dequantize_fp8`), dequantized when it is loaded, in float32, then cast to the compute dtype: there
is no FP8 matmul on this path, so the stage holds it at the compute dtype's size (config check says so).
"""
from __future__ import annotations

import hashlib
import json
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

from pool.computable import (FLOAT_ST_DTYPES, FP8_ST_DTYPE, SUPPORTED_ACTS, SUPPORTED_ARCHS,  # noqa: F401
                             INT4_PARTS, fp8_blocks, int4_scheme, uncomputable)
from stages.int4_checkpoint import dequantized as int4_dequantized, planes as int4_planes
from stages.rope import RopeError, rope_parameters

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FINGERPRINT_SAMPLE_BYTES = 64
# Loads smaller than this stay silent (tiny test models); larger ones report progress on stderr.
PROGRESS_MIN_BYTES = 256 * 1024**2
PROGRESS_EVERY_S = 0.5

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file, tensor or architecture."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's safetensors header entry; `data_start` is the absolute byte offset in `file`."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]
    data_start: int

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors file's header (8-byte little-endian length, then JSON) without reading any data."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} has an unreadable safetensors header: {e}") from e
    header.pop("__metadata__", None)
    return {
        name: TensorInfo(path, e["dtype"], tuple(e["shape"]), tuple(e["data_offsets"]), 8 + n + e["data_offsets"][0])
        for name, e in header.items()
    }


@dataclass
class Checkpoint:
    """A checkpoint directory: `.config` (config.json as a dict), `.arch`, `.num_layers`, lazy `.tensors()`."""

    dir: Path
    config: dict
    arch: str
    infos: dict[str, TensorInfo] = field(repr=False)

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def tie_word_embeddings(self) -> bool:
        """lm_head shares the embedding when the config says so or when the checkpoint has no lm_head."""
        return bool(self.config.get("tie_word_embeddings", False)) or "lm_head.weight" not in self.infos

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint's dtype: `dtype`/`torch_dtype` from config.json, else the embedding's stored dtype."""
        name = self.config.get("dtype") or self.config.get("torch_dtype")
        if name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
        info = self.infos.get("model.embed_tokens.weight") or next(iter(self.infos.values()))
        return _ST_DTYPES[info.dtype]

    @property
    def int4(self) -> dict | None:
        """The GPTQ / AWQ scheme (pool/computable.int4_scheme), or None."""
        return int4_scheme(self.config)

    @property
    def quantized(self) -> bool:
        """Whether projections are stored as packed integers (GPTQ / AWQ): `tensors(keep_quantized=True)` gives
        their Planes."""
        return self.int4 is not None

    def _packed(self, name: str) -> list[str] | None:
        """The stored parts of a GPTQ / AWQ linear's `*.weight` (stages/int4_checkpoint.py), or None."""
        if self.int4 is None or not name.endswith(".weight") or name in self.infos:
            return None
        base = name[: -len("weight")]
        if base + "qweight" not in self.infos:
            return None
        return [base + p for p in INT4_PARTS if base + p in self.infos]

    def has_tensor(self, name: str) -> bool:
        return name in self.infos or self._packed(name) is not None

    def nbytes(self, names: Iterable[str] | None = None) -> int:
        """Stored bytes of the named tensors (all of them by default; a packed weight: its parts)."""
        keys = self.infos.keys() if names is None else names
        return sum(sum(self._info(p).nbytes for p in (self._packed(n) or [n])) for n in keys)

    def fingerprint(self) -> str:
        """sha256 over config.json, every header entry (sorted by name) and each tensor's first 64 bytes."""
        h = hashlib.sha256()
        h.update((self.dir / "config.json").read_bytes())
        by_file: dict[Path, list[tuple[str, TensorInfo]]] = {}
        for name in sorted(self.infos):
            by_file.setdefault(self.infos[name].file, []).append((name, self.infos[name]))
        samples: dict[str, bytes] = {}
        for path, entries in by_file.items():
            with open(path, "rb") as f:
                for name, info in entries:
                    f.seek(info.data_start)
                    samples[name] = f.read(min(FINGERPRINT_SAMPLE_BYTES, info.nbytes))
        for name in sorted(self.infos):
            info = self.infos[name]
            h.update(json.dumps([name, info.dtype, list(info.shape), list(info.offsets)]).encode())
            h.update(samples[name])
        return h.hexdigest()

    def tensors(
        self,
        names: Iterable[str],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        label: str | None = None,
        keep_quantized: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Load only `names` (each at most once), cast to `dtype` when given, onto `device`.

        A name the checkpoint lacks raises `CheckpointError` naming the tensor and the checkpoint before anything
        is read. Loads of `PROGRESS_MIN_BYTES` or more print a throttled progress line on stderr, e.g.
        "loading layers 0-13: 1.2/7.4 GiB".
        """
        names = list(dict.fromkeys(names))
        packed = {n: self._packed(n) for n in names}
        packed = {n: parts for n, parts in packed.items() if parts}
        if packed:  # GPTQ / AWQ projections: their parts read raw, then Planes or the dequantized weight
            out = self.tensors([n for n in names if n not in packed], device, dtype, label, keep_quantized)
            raw = self.tensors([p for parts in packed.values() for p in parts], "cpu")
            for n, parts in packed.items():
                t = {p.rsplit(".", 1)[1]: raw[p] for p in parts}
                kept = int4_planes(self.int4, t) if keep_quantized else None  # type: ignore[arg-type]
                if kept is None:
                    kept = int4_dequantized(self.int4, t).to(device, dtype or self.dtype)  # type: ignore[arg-type]
                out[n] = kept
            return out
        blocks = fp8_blocks(self.config)
        fp8 = {n for n in names if blocks and self._info(n).dtype == FP8_ST_DTYPE and f"{n}_scale_inv" in self.infos}
        for n in names:
            info = self._info(n)
            if dtype is not None and info.dtype not in FLOAT_ST_DTYPES and n not in fp8:
                raise CheckpointError(f"tensor '{n}' of checkpoint {self.dir} is stored as {info.dtype}; the stages "
                                      f"read only {', '.join(FLOAT_ST_DTYPES)} weights")
        total = self.nbytes(names)
        progress = _Progress(label or str(self.dir), total) if total >= PROGRESS_MIN_BYTES else None
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.infos[n].file, []).append(n)
        out: dict[str, torch.Tensor] = {}
        for path, file_names in by_file.items():
            with safe_open(str(path), framework="pt", device=str(torch.device(device))) as f:
                for n in file_names:
                    t = f.get_tensor(n)
                    out[n] = t if dtype is None or n in fp8 else t.to(dtype)
                    if progress:
                        progress.add(self.infos[n].nbytes)
        if progress:
            progress.done()
        if fp8:
            scales = self.tensors([f"{n}_scale_inv" for n in fp8], device)
            for n in fp8:
                w = dequantize_fp8(out[n], scales[f"{n}_scale_inv"], blocks)  # type: ignore[arg-type]
                out[n] = w if dtype is None else w.to(dtype)
        return out

    def _info(self, name: str) -> TensorInfo:
        info = self.infos.get(name)
        if info is None:
            raise CheckpointError(f"tensor '{name}' is missing from checkpoint {self.dir}")
        return info


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-scaled FP8 weight `[N, K]` as float32: each (bn x bk) block times its scale (module docstring)."""
    n, k = w.shape
    bn, bk = block
    if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
        raise CheckpointError(f"an FP8 weight of shape {tuple(w.shape)} needs {-(-n // bn)}x{-(-k // bk)} block "
                              f"scales for {bn}x{bk} blocks, the checkpoint has {tuple(scale.shape)}")
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w.float() * full


def load_checkpoint(dir: str | Path) -> Checkpoint:
    """Read `config.json` and the safetensors headers of a Hugging Face checkpoint directory (a `.gguf` file
    instead: stages/gguf_weights.py, the same interface).

    A config the stages cannot compute (`check_computable`) raises `CheckpointError` naming what, e.g. the
    architecture (`config.json` "architectures"[0]) with the list of supported ones.
    """
    d = Path(dir)
    if d.suffix == ".gguf":
        from stages.gguf_weights import load_gguf

        return load_gguf(d)  # type: ignore[return-value]  # the same interface
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{d} is not a checkpoint directory: config.json not found")
    config = json.loads(cfg_path.read_text())
    check_computable(config, cfg_path)
    return Checkpoint(d, config, config["architectures"][0], _read_infos(d))


def check_computable(config: dict, source: str | Path = "config.json") -> None:
    """Raise `CheckpointError` naming the first thing of `config` the stages do not compute (module docstring)."""
    def refuse(why: str) -> None:
        raise CheckpointError(f"{why} (in {source})")

    why = uncomputable(config)
    if why is not None:
        refuse(why)
    try:
        rope_parameters(config)
    except RopeError as e:
        refuse(str(e))


def _read_infos(d: Path) -> dict[str, TensorInfo]:
    if (d / INDEX_FILE).is_file():
        weight_map = json.loads((d / INDEX_FILE).read_text())["weight_map"]
        infos: dict[str, TensorInfo] = {}
        for shard in sorted(set(weight_map.values())):
            path = d / shard
            if not path.is_file():
                raise CheckpointError(f"shard {shard} listed in {d / INDEX_FILE} is missing")
            infos.update(read_safetensors_header(path))
        listed_only = set(weight_map) - set(infos)
        if listed_only:
            raise CheckpointError(f"{d / INDEX_FILE} lists tensors no shard holds, e.g. '{min(listed_only)}'")
        return infos
    if (d / SINGLE_FILE).is_file():
        return read_safetensors_header(d / SINGLE_FILE)
    raise CheckpointError(f"checkpoint {d} has neither {SINGLE_FILE} nor {INDEX_FILE}")


class _Progress:
    """Throttled "loading <label>: x/y GiB" on stderr (carriage return in place, newline at the end)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done_bytes, self.last = label, total, 0, 0.0

    def add(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self._print("\r")

    def done(self) -> None:
        self._print("\r")
        sys.stderr.write("\n")
        sys.stderr.flush()

    def _print(self, prefix: str) -> None:
        gib = 1024**3
        sys.stderr.write(f"{prefix}loading {self.label}: {self.done_bytes / gib:.1f}/{self.total / gib:.1f} GiB")
        sys.stderr.flush()
