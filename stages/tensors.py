"""torch tensors to and from the wire's RawTensor, and torch views over the pool file.

`pool/` imports no torch, so the conversions live here, on the stage side:
- `to_raw` never copies a contiguous CPU tensor: the RawTensor's bytes alias the tensor's storage (and keep
  it alive), so the tensor must not change until the frames are sent. Non-contiguous tensors are made
  contiguous and CUDA tensors copied to the CPU first (both copies).
- `from_raw` returns a tensor that is always writable and always safe to keep: it wraps the received bytes
  without a copy when they are writable, and copies them when they are read-only (a `bytes` frame, a zmq
  frame) rather than hand out a tensor whose writes would be undefined.
- `pool_array` wraps one array of a `PoolMemory` file with `torch.frombuffer` (no copy: writes land in the
  shared file).
"""
from __future__ import annotations

import warnings

import torch

from pool.memory import PoolMemory
from pool.wire import RawTensor, WireError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire's name for a torch dtype; WireError for one the wire does not carry."""
    try:
        return NAMES[dtype]
    except KeyError:
        raise WireError(f"torch dtype {dtype} cannot go on the wire; use one of {', '.join(DTYPES)}") from None


def to_raw(t: torch.Tensor) -> RawTensor:
    """A RawTensor over `t`'s bytes in C order (bfloat16 travels as its raw 2-byte words)."""
    name = dtype_name(t.dtype)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    # numpy has no bfloat16: every dtype goes out as its bytes, viewed as uint8 (a view, not a copy).
    flat = t.reshape(-1).view(torch.uint8)
    return RawTensor(name, tuple(t.shape), memoryview(flat.numpy()))


def from_raw(r: RawTensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """A writable tensor of r's dtype and shape on `device`; shares r's bytes only when they are writable."""
    dtype = DTYPES[r.dtype]
    device = torch.device(device)
    if r.nbytes == 0:  # torch.frombuffer refuses an empty buffer
        return torch.empty(r.shape, dtype=dtype, device=device)
    if r.data.readonly:
        if device.type == "cpu":
            return torch.frombuffer(bytearray(r.data), dtype=dtype).reshape(r.shape)
        with warnings.catch_warnings():  # only read, by the copy to the device
            warnings.filterwarnings("ignore", message=".*not writable.*")
            host = torch.frombuffer(r.data, dtype=dtype)
        return host.to(device).reshape(r.shape)
    return torch.frombuffer(r.data, dtype=dtype).reshape(r.shape).to(device)


def pool_array(mem: PoolMemory, layer: int, which: str) -> torch.Tensor:
    """The `which` array ("k", "v", "k_scale", "v_scale") of local `layer`, a view into the pool file."""
    return mapped(mem.buffer, *mem.layout.tensor_spec(layer, which))


def mapped(buffer, offset: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of dtype `name` and `shape` viewing `buffer` (a file mapping) from byte `offset`."""
    count = 1
    for d in shape:
        count *= d
    return torch.frombuffer(buffer, dtype=DTYPES[name], count=count, offset=offset).view(shape)
