"""Messages between the coordinator and the stages, and between stages: frames, no torch, no pickle.

A message is a list of frames::

    frame 0      kind, ASCII (b"STEP", b"HIDDEN", ...; one of KINDS)
    frame 1      header, a msgpack map (str or int keys; values: nil, bool, int, float, str, bin, arrays, maps)
    frame 2..    tensor bytes, raw, one frame per tensor, in order

The tensors' dtype and shape travel in the header under the reserved key "_tensors" as
[[dtype, [d0, d1, ...]], ...]; `decode` takes that key out and returns RawTensors whose `data` is a
memoryview of the received frame (no copy on either side: `encode` passes the caller's buffer through).

Protocol version: HELLO and WELCOME (the handshake, both directions) carry "protocol"; `encode` fills in
PROTOCOL when the caller leaves it out, and `decode` refuses a HELLO or WELCOME whose version differs.
The other messages do not carry it: they only flow on a connection whose handshake agreed, and per-step
headers stay small.

Safety: msgpack is read with raw=False and strict_map_key=False; ext types (the only way msgpack carries
arbitrary objects, Timestamp included) are refused, and nothing is ever unpickled. Every malformed input
raises WireError with a message saying what was wrong.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

PROTOCOL = 4  # 2: SAVE/LOAD/DONE, generations in OPS and in the stage's HELLO; 3: the box token in HELLO and HIDDEN;
# 4: SAMPLES, from the last stage to the first (pool/step_chain.py rule 6)

HELLO, WELCOME, OPS, STEP, HIDDEN = "HELLO", "WELCOME", "OPS", "STEP", "HIDDEN"
RESULT, ERROR, PING, PONG, BYE = "RESULT", "ERROR", "PING", "PONG", "BYE"
SAVE, LOAD, DONE = "SAVE", "LOAD", "DONE"  # session files: requests on the ordered stream, and each stage's answer
SAMPLES = "SAMPLES"  # the last stage's samples of a step, to the first stage (pool/step_chain.py rule 6)
KINDS = frozenset({HELLO, WELCOME, OPS, STEP, HIDDEN, RESULT, ERROR, PING, PONG, BYE, SAVE, LOAD, DONE, SAMPLES})
HANDSHAKE_KINDS = frozenset({HELLO, WELCOME})

TENSORS_KEY = "_tensors"
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "int8": 1, "uint8": 1,
}


class WireError(ValueError):
    """A message that cannot be encoded or decoded; the message says why."""


@dataclass(frozen=True)
class RawTensor:
    """A tensor's bytes without torch: C-order, native (little-endian) byte order.

    `data` is normalised to a flat unsigned-byte memoryview over the caller's buffer (no copy); its length
    must be exactly prod(shape) * itemsize of dtype.
    """

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise WireError(f"tensor dtype {self.dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
        shape = tuple(self.shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise WireError(f"tensor shape {self.shape!r}: dimensions must be non-negative ints")
        try:
            view = memoryview(self.data)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
        except (TypeError, ValueError) as err:
            raise WireError(f"tensor data must be a C-contiguous buffer: {err}") from None
        if view.nbytes != self.expected_nbytes(self.dtype, shape):
            raise WireError(
                f"tensor {self.dtype}{list(shape)} needs {self.expected_nbytes(self.dtype, shape)} bytes, "
                f"its data has {view.nbytes}"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "data", view)

    @staticmethod
    def expected_nbytes(dtype: str, shape: Sequence[int]) -> int:
        n = DTYPE_SIZES[dtype]
        for d in shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def _kind_name(kind: str | bytes) -> str:
    name = kind.decode("ascii", "replace") if isinstance(kind, (bytes, bytearray)) else kind
    if name not in KINDS:
        raise WireError(f"unknown message kind {kind!r}; known: {', '.join(sorted(KINDS))}")
    return name


def encode(kind: str | bytes, header: dict, tensors: Iterable[RawTensor] = ()) -> list[bytes | memoryview]:
    """Frames for one message: [kind, msgpack header, *tensor bytes]; tensor buffers are not copied."""
    name = _kind_name(kind)
    if not isinstance(header, dict):
        raise WireError(f"{name}: header must be a dict, got {type(header).__name__}")
    if TENSORS_KEY in header:
        raise WireError(f"{name}: header key {TENSORS_KEY!r} is reserved for the tensor list")
    tensors = list(tensors)
    body: dict[Any, Any] = dict(header)
    if name in HANDSHAKE_KINDS:
        body.setdefault("protocol", PROTOCOL)
    if tensors:
        for t in tensors:
            if not isinstance(t, RawTensor):
                raise WireError(f"{name}: tensors must be RawTensor, got {type(t).__name__}")
        body[TENSORS_KEY] = [[t.dtype, list(t.shape)] for t in tensors]
    try:
        packed = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as err:
        raise WireError(f"{name}: header cannot be packed with msgpack: {err}") from None
    return [name.encode("ascii"), packed, *(t.data for t in tensors)]


def _refuse_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack ext types are not accepted (got type {code})")


def _as_view(frame: Any) -> memoryview:
    """A byte view of a frame: bytes, bytearray, memoryview or a zmq.Frame (all expose the buffer protocol)."""
    try:
        view = memoryview(frame)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError):
        raise WireError(f"frame of type {type(frame).__name__} is not a contiguous buffer") from None


def _unpack_header(name: str, frame: Any) -> dict:
    try:
        header = msgpack.unpackb(
            _as_view(frame), raw=False, strict_map_key=False, ext_hook=_refuse_ext, max_ext_len=0, use_list=True
        )
    except WireError:
        raise
    except Exception as err:  # msgpack raises ValueError subclasses, TypeError, StackError...
        # max_ext_len=0 stops every ext payload before any hook, Timestamp (type -1) included.
        if "max_ext_len" in str(err) or "timestamp" in str(err):
            raise WireError(f"{name}: msgpack ext types are not accepted") from None
        raise WireError(f"{name}: header is not valid msgpack ({type(err).__name__}: {err})") from None
    if not isinstance(header, dict):
        raise WireError(f"{name}: header must be a msgpack map, got {type(header).__name__}")
    return header


def _tensor_specs(name: str, specs: Any) -> list[tuple[str, tuple[int, ...]]]:
    if not isinstance(specs, list):
        raise WireError(f"{name}: {TENSORS_KEY} must be a list of [dtype, shape], got {type(specs).__name__}")
    out = []
    for i, spec in enumerate(specs):
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], list)):
            raise WireError(f"{name}: tensor {i} spec {spec!r} is not [dtype, shape]")
        dtype, shape = spec
        if dtype not in DTYPE_SIZES:
            raise WireError(f"{name}: tensor {i} dtype {dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise WireError(f"{name}: tensor {i} shape {shape!r}: dimensions must be non-negative ints")
        out.append((dtype, tuple(shape)))
    return out


def decode(frames: Sequence[Any]) -> tuple[str, dict, list[RawTensor]]:
    """(kind, header without the tensor key, tensors) of one received message; WireError if malformed."""
    frames = list(frames)
    if len(frames) < 2:
        raise WireError(f"a message needs at least 2 frames (kind, header), got {len(frames)}")
    name = _kind_name(bytes(_as_view(frames[0])))
    header = _unpack_header(name, frames[1])
    specs = _tensor_specs(name, header.pop(TENSORS_KEY, []))
    if len(specs) != len(frames) - 2:
        raise WireError(f"{name}: header lists {len(specs)} tensors but {len(frames) - 2} tensor frames came")
    if name in HANDSHAKE_KINDS and header.get("protocol") != PROTOCOL:
        raise WireError(
            f"{name}: protocol {header.get('protocol')!r} is not this side's protocol {PROTOCOL}; "
            "run the same Strata version on the coordinator and every stage"
        )
    tensors = []
    for i, ((dtype, shape), frame) in enumerate(zip(specs, frames[2:])):
        view = _as_view(frame)
        want = RawTensor.expected_nbytes(dtype, shape)
        if view.nbytes != want:
            raise WireError(f"{name}: tensor {i} {dtype}{list(shape)} needs {want} bytes, its frame has {view.nbytes}")
        tensors.append(RawTensor(dtype, shape, view))
    return name, header, tensors
