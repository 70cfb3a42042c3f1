"""The elementwise work of a CPU stage's layers in C (csrc/cpu_layer_ops.c).

A decode step of a small model on a CPU spends a fifth of its time between the matrix products: each RMSNorm, the
q/k norm with the rotary embedding, the SiLU-gated product and the residual adds are several torch ops on a few
rows, each a dispatch and an allocation, run with caches the streamed weights have just emptied (the 104M qwen3,
one row: 3.6 of 18.9 ms; docs/BENCHMARKS.md). Here each is one call.

Rules:
1. Only for float32 tensors on a CPU, rows contiguous (qkv: its rows may be wider than the heads), weights float32
   of the row's width, full rotary (cos/sin as wide as a head); `rms_norm` and friends return None otherwise and
   the torch code in stages/model.py runs, unchanged.
2. The same math as the torch code, in the same order (x times its inverse RMS, then the weight; a residual add
   before the norm it feeds; rotate-half), to float32 rounding: the sums run in another order, multiply-adds
   may fuse, and exp is the library's own (2e-7 relative). The first-use check and the tests hold it to the torch
   code; the transformers oracle tests run it.
3. A call's rows are shared by torch's threads only when they hold at least PARALLEL_FLOATS values (a prefill
   piece); a decode step's rows stay on the calling thread.
4. The library is compiled, cached and trusted by the rules of stages/cpu_build.py, and checked against the torch
   code before first use; a failure leaves `available()` False with `unavailable_reason()` (logged once).
   `STRATA_CPU_KERNELS=0` turns it off.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from stages import cpu_build
from stages.cpu_build import KernelRefused

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_layer_ops.c"
MAX_HEAD_DIM = 1024  # MAX_HEAD_DIM in the source
PARALLEL_FLOATS = 65536  # PARALLEL_FLOATS in the source

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "strata_rms_norm": [_P, _P, _P, _P, _P, _L, _I, _F, _I],
    "strata_qk_norm_rope": [_P, _L, _L, _I, _I, _I, _P, _P, _F, _P, _P, _I],
    "strata_silu_mul": [_P, _P, _L, _I, _I],
}


def build() -> Path:
    return cpu_build.build(SOURCE, "cpu_layer_ops")


@lru_cache(maxsize=1)
def _library() -> tuple[dict[str, object] | None, str | None]:
    """({name: function}, None), or (None, why not): built, loaded and checked once per process."""
    return cpu_build.load(build, _SIGNATURES, _self_check, "CPU layer ops")


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> str | None:
    return _library()[1]


def _f32(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in tensors)


def _call(name: str, *args) -> None:
    fns = _library()[0]
    if fns[name](*args, torch.get_num_threads()) != 0:
        raise ValueError(f"{name} refused its arguments")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(s, rms_norm(s) * weight) with s = x + residual (s = x without one), or None outside rule 1."""
    n = x.shape[-1]
    if not (_f32(x, weight, residual) and x.is_contiguous() and (weight is None or weight.shape == (n,))
            and (residual is None or (residual.shape == x.shape and residual.is_contiguous())) and available()):
        return None
    weight = None if weight is None else weight.contiguous()
    s = x if residual is None else torch.empty_like(x)
    out = torch.empty_like(x)
    _call("strata_rms_norm", x.data_ptr(), _ptr(residual), None if residual is None else s.data_ptr(), _ptr(weight),
          out.data_ptr(), x.numel() // n, n, float(eps))
    return s, out


def qk_norm_rope_(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """In place on the q and k heads at the start of each row of `qkv [T, width]`: each head normed (q_norm,
    k_norm; both None: not normed), then rotated by its row of cos, sin `[T, head_dim]`. False (nothing done)
    outside rule 1."""
    t = qkv.shape[0]
    if not (_f32(qkv, q_norm, k_norm, cos, sin) and qkv.dim() == 2 and qkv.stride(1) == 1
            and qkv.shape[1] >= (heads + kv_heads) * head_dim and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM
            and (q_norm is None) == (k_norm is None)
            and (q_norm is None or (q_norm.shape == (head_dim,) and k_norm.shape == (head_dim,)))
            and cos.shape == (t, head_dim) and sin.shape == (t, head_dim) and available()):
        return False
    cos, sin = cos.contiguous(), sin.contiguous()
    q_norm = None if q_norm is None else q_norm.contiguous()
    k_norm = None if k_norm is None else k_norm.contiguous()
    _call("strata_qk_norm_rope", qkv.data_ptr(), qkv.stride(0), t, heads, kv_heads, head_dim, _ptr(q_norm),
          _ptr(k_norm), float(eps), cos.data_ptr(), sin.data_ptr())
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of `gate_up [T, 2 * inter]` (gate then up) -> `[T, inter]`, or None outside rule 1."""
    if not (_f32(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0
            and available()):
        return None
    inter = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], inter)
    _call("strata_silu_mul", gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter)
    return out


def _self_check(fns: dict[str, object]) -> None:
    """Rule 4: each function against the torch code on seeded rows, few and many (rule 3's threads)."""
    from stages.model import qk_norm, rms_norm as torch_rms_norm
    from stages.rope import apply_rope

    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)

    def close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            raise KernelRefused(f"{name} of the compiled library disagrees with torch by "
                                f"{(got - want).abs().max().item():.2e}")

    with torch.inference_mode():
        for rows in (3, 2 * PARALLEL_FLOATS // 96):
            x, d = torch.randn(rows, 96, generator=g), torch.randn(rows, 96, generator=g)
            w = torch.randn(96, generator=g)
            s, out = torch.empty_like(x), torch.empty_like(x)
            fns["strata_rms_norm"](x.data_ptr(), d.data_ptr(), s.data_ptr(), w.data_ptr(), out.data_ptr(), rows, 96,
                                   1e-6, threads)
            close("strata_rms_norm", out, torch_rms_norm(x + d, w, 1e-6))
            heads, kv_heads, hd = 4, 2, 32
            qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd + 8, generator=g)
            qn, kn = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
            ang = torch.randn(rows, hd, generator=g)
            cos, sin = ang.cos(), ang.sin()
            qk = qkv[:, :(heads + kv_heads) * hd].view(rows, heads + kv_heads, hd)
            want = apply_rope(qk_norm(qk, qn, kn, heads, 1e-6), cos, sin)
            fns["strata_qk_norm_rope"](qkv.data_ptr(), qkv.stride(0), rows, heads, kv_heads, hd, qn.data_ptr(),
                                       kn.data_ptr(), 1e-6, cos.data_ptr(), sin.data_ptr(), threads)
            close("strata_qk_norm_rope", qk, want)
            gu = torch.randn(rows, 64, generator=g) * 8
            out = torch.empty(rows, 32)
            fns["strata_silu_mul"](gu.data_ptr(), out.data_ptr(), rows, 32, threads)
            close("strata_silu_mul", out, F.silu(gu[:, :32]) * gu[:, 32:])
