"""stages/tensors.py: torch <-> RawTensor, bit for bit, through encode/decode and a real zmq socket."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import zmq

from pool import wire
from pool.memory import PoolLayout, PoolMemory
from pool.wire import RawTensor, WireError, decode, encode
from stages.tensors import from_raw, pool_array, to_raw

GEN = torch.Generator().manual_seed(0)


def _tensors() -> dict[str, torch.Tensor]:
    base = torch.randn(6, 10, generator=GEN)
    return {
        "float32": base,
        "bfloat16": base.to(torch.bfloat16),
        "float16": base.to(torch.float16),
        "int32": torch.randint(-2**31, 2**31 - 1, (7,), dtype=torch.int32, generator=GEN),
        "int64": torch.randint(-2**62, 2**62, (3, 2), dtype=torch.int64, generator=GEN),
        "int8": torch.randint(-128, 127, (5, 3), dtype=torch.int8, generator=GEN),
        "uint8": torch.randint(0, 255, (4,), dtype=torch.uint8, generator=GEN),
        "empty": torch.zeros(0, 16, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "transposed": base.t(),  # non-contiguous
        "strided": base[::2, 1::3].to(torch.bfloat16),  # non-contiguous with an offset
        "requires grad": base.clone().requires_grad_(True),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe): compare the bytes, not the values."""
    a, b = a.detach().contiguous(), b.detach().contiguous()
    same_bytes = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return a.dtype == b.dtype and a.shape == b.shape and same_bytes


@pytest.mark.parametrize("name", list(_tensors()))
def test_round_trip_through_encode_decode(name: str) -> None:
    t = _tensors()[name]
    r = to_raw(t)
    assert r.shape == tuple(t.shape) and r.nbytes == t.numel() * t.element_size()
    kind, header, (back,) = decode([bytes(f) for f in encode(wire.HIDDEN, {"step": 3}, [r])])
    out = from_raw(back)
    assert _same(out, t)
    out.add_(1)  # writable, and independent of the read-only frame it came from
    assert _same(from_raw(back), t)


def test_bfloat16_keeps_every_bit() -> None:
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)  # every bf16 pattern, NaNs included
    t = bits.view(torch.bfloat16)
    assert torch.equal(from_raw(to_raw(t)).view(torch.int16), bits)


def test_to_raw_aliases_a_contiguous_cpu_tensor() -> None:
    t = torch.zeros(4, dtype=torch.float32)
    r = to_raw(t)
    t[0] = 1.0  # no copy was made: the bytes going out are the tensor's
    assert from_raw(r)[0].item() == 1.0


def test_from_raw_shares_writable_bytes_and_copies_read_only_ones() -> None:
    buf = bytearray(8)
    shared = from_raw(RawTensor("int32", (2,), buf))
    shared[1] = 7
    assert buf[4] == 7

    frozen = bytes(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it wraps a read-only buffer: it must not here
        copied = from_raw(RawTensor("int32", (2,), frozen))
    copied[0] = 5
    assert frozen == bytes(8)


def test_unsupported_dtype_refused() -> None:
    with pytest.raises(WireError, match="torch.float64 cannot go on the wire"):
        to_raw(torch.zeros(2, dtype=torch.float64))


def test_round_trip_over_zmq_ipc(tmp_path: Path) -> None:
    tensors = _tensors()
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        for s in (push, pull):
            s.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVTIMEO, 5000)
        pull.bind(f"ipc://{tmp_path}/hidden")
        push.connect(f"ipc://{tmp_path}/hidden")
        big = torch.randn(512, 1024, generator=GEN).to(torch.bfloat16)  # 1 MiB, sent without a copy
        push.send_multipart(encode(wire.HIDDEN, {"step": 41}, [to_raw(t) for t in [*tensors.values(), big]]),
                            copy=False)
        kind, header, raws = decode(pull.recv_multipart(copy=False))
        assert (kind, header) == ("HIDDEN", {"step": 41})
        for t, r in zip([*tensors.values(), big], raws, strict=True):
            assert _same(from_raw(r), t)
    finally:
        push.close()
        pull.close()
        ctx.term()


def test_pool_array_writes_land_in_the_file(tmp_path: Path) -> None:
    layout = PoolLayout(n_layers=2, n_chunks=3, chunk_cells=16, kv_heads=2, head_dim=8, kv_dtype="int8")
    with PoolMemory.create(tmp_path / "pool", layout) as mem:
        k, scale = pool_array(mem, 1, "k"), pool_array(mem, 1, "v_scale")
        assert (k.dtype, k.shape, scale.dtype, scale.shape) == (torch.int8, (4, 16, 2, 8), torch.float32, (4, 16, 2))
        k[2, 5, 1, 3] = -7
        scale[1, 0, 0] = 0.25
        del k, scale
    with PoolMemory.attach(tmp_path / "pool", layout) as mem:
        offset, _, _ = layout.tensor_spec(1, "k")
        assert mem.buffer[offset + ((2 * 16 + 5) * 2 + 1) * 8 + 3] == 256 - 7  # [chunk, cell, head, dim], C order
        assert pool_array(mem, 1, "v_scale")[1, 0, 0].item() == 0.25
        assert not pool_array(mem, 0, "k").any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors() -> None:
    t = torch.randn(33, 17, generator=GEN).to("cuda", torch.bfloat16)
    r = to_raw(t.t())
    back = from_raw(r, device="cuda")
    assert back.device.type == "cuda" and _same(back.cpu(), t.t().cpu())
    frozen = RawTensor("float32", (2,), bytes(8))
    assert from_raw(frozen, device="cuda").sum().item() == 0.0
