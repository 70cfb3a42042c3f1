"""Page-locking host memory with cudaHostRegister, through ctypes (no torch): host<->device copies of a
pinned range run as DMA instead of through a staging buffer.

Rules:
- No CUDA is not an error: without a loadable libcudart, or without a device, nothing is registered and
  `host_register` returns None. libcudart is found without importing torch (the copy inside torch's
  nvidia-cuda-runtime wheel is on the search list).
- The range is registered in pieces of at most `_PIN_PIECE` bytes (64 GiB): one registration of a larger
  range fails on some drivers.
- Pieces are registered portable (pinned for every CUDA context, not only the current one).
- All or nothing: when CUDA refuses a piece, the pieces already registered are unregistered before
  `PinError` is raised.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from typing import Callable

_PIN_PIECE = 64 << 30  # cudaHostRegister is called on pieces of at most this many bytes

Pieces = list[tuple[int, int]]  # (address, bytes) of each registered piece


class PinError(RuntimeError):
    """CUDA is present but refused to register the mapping (e.g. the memlock limit)."""


def host_register(address: Callable[[], int], nbytes: int, device: int | None,
                  what: str) -> tuple[ctypes.CDLL, Pieces] | None:
    """Register `nbytes` from `address()` with CUDA; (libcudart, pieces) to unregister later, or None without CUDA.

    `address` is called only once CUDA is known to be present. `device`, if given, is made current first so
    the registration does not create a context on device 0. `what` names the memory in a PinError.
    """
    cudart = _load_cudart()
    if cudart is None:
        return None
    count = ctypes.c_int(0)
    if cudart.cudaGetDeviceCount(ctypes.byref(count)) != 0 or count.value == 0:
        return None
    if device is not None:
        _cuda_check(cudart, cudart.cudaSetDevice(int(device)), f"cudaSetDevice({device})")
    base = address()
    portable = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one
    done: Pieces = []
    for start in range(0, nbytes, _PIN_PIECE):
        size = min(_PIN_PIECE, nbytes - start)
        err = cudart.cudaHostRegister(ctypes.c_void_p(base + start), ctypes.c_size_t(size), portable)
        if err != 0:
            host_unregister(cudart, done)
            _cuda_check(cudart, err, f"cudaHostRegister({size} bytes at +{start}) of {what}")
        done.append((base + start, size))
    return cudart, done


def host_unregister(cudart: ctypes.CDLL, pieces: Pieces) -> None:
    """Unregister every piece `host_register` returned."""
    for ptr, _ in pieces:
        cudart.cudaHostUnregister(ctypes.c_void_p(ptr))


_CUDART: list[ctypes.CDLL | None] = []  # memo: [] untried, [None] absent, [lib] loaded


def _cudart_candidates() -> list[str]:
    names = ["libcudart.so", "libcudart.so.12", "libcudart.so.13"]
    for entry in sys.path:  # the copy inside torch's nvidia-cuda-runtime wheel, without importing torch
        for sub in ("nvidia/cuda_runtime/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"):
            names += sorted(glob.glob(os.path.join(entry, sub, "libcudart.so*")))
    return names


def _load_cudart() -> ctypes.CDLL | None:
    """libcudart through ctypes, or None when no CUDA runtime can be loaded."""
    if _CUDART:
        return _CUDART[0]
    lib = None
    for name in _cudart_candidates():
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is not None:
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
    _CUDART.append(lib)
    return lib


def _cuda_check(cudart: ctypes.CDLL, err: int, what: str) -> None:
    if err != 0:
        message = cudart.cudaGetErrorString(err).decode(errors="replace")
        raise PinError(f"{what} failed: CUDA error {err} ({message})")
