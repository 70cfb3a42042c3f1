"""pool/pin.py through PoolMemory.pin/unpin: a no-op without CUDA, pieces registered and undone, PinError.

A fake libcudart records the calls, so the pieces and the undo on failure are checked on any host.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from pool import pin
from pool.memory import PoolLayout, PoolMemory
from pool.pin import PinError

BASE = PoolLayout(n_layers=2, n_chunks=6, chunk_cells=16, kv_heads=2, head_dim=8, kv_dtype="float16")


@pytest.fixture
def pool_path(tmp_path: Path) -> Path:
    return tmp_path / "pool-share"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def test_pin_is_a_no_op_without_cuda(pool_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pin, "_load_cudart", lambda: None)
    with PoolMemory.create(pool_path, BASE) as mem:
        assert mem.pin() is False and not mem.pinned
        assert mem.unpin() is False


@pytest.mark.skipif(_cuda_available(), reason="CUDA present: test_pin_and_copy_to_device covers it")
def test_pin_returns_false_on_this_host(pool_path: Path) -> None:
    with PoolMemory.create(pool_path, BASE) as mem:
        assert mem.pin() is False and mem.unpin() is False


class FakeCudart:
    """Records cudaHostRegister calls the way libcudart would receive them through ctypes."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.fail_at = fail_at

    def cudaGetDeviceCount(self, ref) -> int:
        ref._obj.value = 1
        return 0

    def cudaSetDevice(self, device: int) -> int:
        return 0

    def cudaHostRegister(self, ptr: ctypes.c_void_p, size: ctypes.c_size_t, flags: int) -> int:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((ptr.value, size.value))
        return 0

    def cudaHostUnregister(self, ptr: ctypes.c_void_p) -> int:
        self.unregistered.append(ptr.value)
        return 0

    def cudaGetErrorString(self, err: int) -> bytes:
        return b"out of memory"


def test_pin_registers_in_pieces_and_unpins_them(pool_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudart()
    monkeypatch.setattr(pin, "_load_cudart", lambda: fake)
    monkeypatch.setattr(pin, "_PIN_PIECE", 1024)
    with PoolMemory.create(pool_path, BASE) as mem:
        assert mem.pin(device=0) is True and mem.pinned and mem.pin() is True
        base = mem._address()
        sizes = [size for _, size in fake.registered]
        assert [ptr - base for ptr, _ in fake.registered] == list(range(0, BASE.nbytes, 1024))
        assert sum(sizes) == BASE.nbytes and max(sizes) == 1024
        assert mem.unpin() is True and not mem.pinned
        assert fake.unregistered == [ptr for ptr, _ in fake.registered]
        mem.pin()
    assert len(fake.registered) == 2 * len(sizes)
    assert fake.unregistered == [ptr for ptr, _ in fake.registered]  # close() unpinned the second pin


def test_pin_failure_undoes_pieces_and_raises(pool_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudart(fail_at=2)
    monkeypatch.setattr(pin, "_load_cudart", lambda: fake)
    monkeypatch.setattr(pin, "_PIN_PIECE", 1024)
    with PoolMemory.create(pool_path, BASE) as mem:
        with pytest.raises(PinError, match=r"cudaHostRegister\(1024 bytes at \+2048\).*out of memory"):
            mem.pin()
        assert fake.unregistered == [ptr for ptr, _ in fake.registered] and not mem.pinned


@pytest.mark.skipif(not _cuda_available(), reason="needs CUDA")
def test_pin_and_copy_to_device(pool_path: Path) -> None:
    import torch

    from stages.tensors import pool_array

    layout = PoolLayout(n_layers=2, n_chunks=64, chunk_cells=256, kv_heads=8, head_dim=128, kv_dtype="bfloat16")
    with PoolMemory.create(pool_path, layout) as mem:
        assert mem.pin(device=torch.cuda.current_device()) is True
        k = pool_array(mem, 1, "k")
        assert k.is_pinned()
        k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
        on_device = k.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_device.cpu(), k)
        k[3].copy_(on_device[5], non_blocking=True)  # device -> pinned host, the swap-in direction
        torch.cuda.synchronize()
        assert torch.equal(k[3], k[5])
        del k
        assert mem.unpin() is True
