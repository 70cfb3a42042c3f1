"""csrc/cpu_isa.h: the packed-rows and byte-rows kernels built for AVX2 (`-mno-avx512f`) multiply as the build for
this CPU does, bit for bit, and as F.linear in float64 does to float32 rounding. On a CPU with AVX-512 this compares
the two widths; on one with AVX2 only, the build for this CPU is the AVX2 one, checked against F.linear."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from stages import byte_rows, cpu_build, packed_rows
from stages.packed_linear import PackedLinear

AVX2 = ("-mno-avx512f",)


def _avx2(module, stem: str, tmp_path, monkeypatch) -> dict:
    """The module's library built without AVX-512 into a fresh cache, its functions typed as the module types them."""
    if not module.available():
        pytest.skip(f"no {stem} kernel here: {module.unavailable_reason()}")
    monkeypatch.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "kernels"))
    lib = ctypes.CDLL(str(cpu_build.build(module.SOURCE, stem, AVX2)))
    fns = {}
    for name, argtypes in module._SIGNATURES.items():
        fns[name] = fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    isa = fns[f"strata_{stem.removeprefix('cpu_')}_isa"]()
    if isa != 256:
        pytest.skip(f"this CPU has no AVX2 with FMA (the build says {isa})")
    return fns


@pytest.mark.parametrize("shape", [(200, 96), (1280, 771), (768, 3072)])
def test_packed_rows_of_both_widths_agree(shape, tmp_path, monkeypatch):
    """1 to MAX_ROWS rows (a row alone, half-panel passes of 3, a last pass of 1 or 2), N and K not whole panels."""
    fns = _avx2(packed_rows, "cpu_packed_rows", tmp_path, monkeypatch)
    g = torch.Generator().manual_seed(shape[1])
    w, b = torch.randn(*shape, generator=g) / shape[1] ** 0.5, torch.randn(shape[0], generator=g)
    p = PackedLinear(w).panels
    if p is None:
        pytest.skip(f"oneDNN does not pack a [{shape[0]}, {shape[1]}] weight here as {packed_rows.PANEL}-column panels")
    for rows in range(1, packed_rows.MAX_ROWS + 1):
        x = torch.randn(rows, shape[1], generator=g)
        for bias in (b, None):
            native = packed_rows.multiply(p, x, bias)
            out = torch.empty_like(native)
            assert fns["strata_packed_rows"](x.data_ptr(), rows, p.k, p.address, p.n, p.kp,
                                             None if bias is None else bias.data_ptr(), out.data_ptr(),
                                             torch.get_num_threads()) == 0
            assert torch.equal(out, native), (rows, (out - native).abs().max().item())
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits, shape, group", [(bits, shape, group) for bits in (8, 4)
                                                for shape, group in (((96, 256), 32), ((37, 512), 128), ((130, 96), 32))]
                         + [(8, (40, 288), 16)])  # groups of 16: bytes only (byte_rows rule 1)
def test_byte_rows_of_both_widths_agree(bits, shape, group, tmp_path, monkeypatch):
    """1 to MAX_ROWS rows (groups of 4 rows over one output), and the whole weight dequantized into float32 and
    bfloat16: the same values from both builds, the products F.linear's over the dequantized weight."""
    fns = _avx2(byte_rows, "cpu_byte_rows", tmp_path, monkeypatch)
    native = byte_rows._library()[0]
    n, k = shape
    g = torch.Generator().manual_seed(n + bits)
    values = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    q = values if bits == 8 else byte_rows.nibbles(values)
    s = torch.rand(n, k // group, generator=g) * 0.01
    off = torch.randn(n, k // group, generator=g) * 0.1
    w = (values.float().view(n, -1, group) * s.unsqueeze(-1) + off.unsqueeze(-1)).view(n, k)
    bias = torch.randn(n, generator=g)
    for rows in range(1, byte_rows.MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=g)
        got = byte_rows._multiply(fns, x, q, bits, s, off, group, bias)
        assert torch.equal(got, byte_rows._multiply(native, x, q, bits, s, off, group, bias)), rows
        torch.testing.assert_close(got.double(), F.linear(x.double(), w.double(), bias.double()), rtol=1e-5,
                                   atol=1e-4)
    for bf16, dtype in ((0, torch.float32), (1, torch.bfloat16)):
        outs = []
        for lib in (fns, native):
            out = torch.empty(n, k, dtype=dtype)
            assert lib["strata_byte_dequant"](q.data_ptr(), bits, s.data_ptr(), off.data_ptr(), 0.0, n, k, group,
                                              out.data_ptr(), bf16, 2) == 0
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        torch.testing.assert_close(outs[0].float(), w, rtol=2 ** -8 if bf16 else 1e-6, atol=1e-6)  # one rounding
