"""pool/wire.py: frames out and back, over a real zmq socket, every malformed input refused, no pickle."""
from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from pool import wire
from pool.wire import PROTOCOL, RawTensor, WireError, decode, encode


def _raw(arr: np.ndarray, dtype: str) -> RawTensor:
    return RawTensor(dtype, arr.shape, memoryview(np.ascontiguousarray(arr)))


def test_round_trip_header_and_tensors() -> None:
    ids = np.arange(7, dtype=np.int32)
    hidden = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    header = {"step": 9, "version": 4, "slots": [[0, 10, 3, 1], [2, 0, 4, 0]], "sampling": {1: {"t": 0.5, "s": "x"}},
              "blob": b"\x00\x01", "none": None, "ok": True}
    frames = encode(wire.STEP, header, [_raw(ids, "int32"), _raw(hidden, "float32")])
    assert frames[0] == b"STEP" and len(frames) == 4

    kind, got, tensors = decode([bytes(f) for f in frames])
    assert kind == "STEP" and got == header  # int map keys survive, the tensor key is taken out
    assert [(t.dtype, t.shape) for t in tensors] == [("int32", (7,)), ("float32", (3, 4))]
    assert np.array_equal(np.frombuffer(tensors[0].data, np.int32), ids)
    assert np.array_equal(np.frombuffer(tensors[1].data, np.float32).reshape(3, 4), hidden)


def test_empty_and_scalar_tensors_and_bytes_kinds() -> None:
    empty = RawTensor("bfloat16", (0, 8), b"")
    scalar = RawTensor("int64", (), struct.pack("<q", -5))
    kind, header, (e, s) = decode(encode(b"HIDDEN", {"step": 1}, [empty, scalar]))
    assert kind == "HIDDEN" and header == {"step": 1}
    assert (e.dtype, e.shape, e.nbytes) == ("bfloat16", (0, 8), 0)
    assert (s.shape, struct.unpack("<q", s.data)[0]) == ((), -5)


def test_encode_passes_buffers_through_without_copy() -> None:
    buf = bytearray(16)
    frames = encode("HIDDEN", {"step": 1}, [RawTensor("float32", (4,), buf)])
    buf[0] = 0x7F  # a change after encode shows in the frame: the frame is the caller's memory
    assert isinstance(frames[2], memoryview) and frames[2].obj is buf and frames[2][0] == 0x7F
    kind, _, (t,) = decode(frames)
    assert t.data.obj is buf  # and decode does not copy either


def test_protocol_in_the_handshake_only() -> None:
    for kind in (wire.HELLO, wire.WELCOME):
        _, header, _ = decode(encode(kind, {"stage": 0}))
        assert header == {"stage": 0, "protocol": PROTOCOL}
    _, header, _ = decode(encode(wire.PING, {}))
    assert header == {}
    assert sorted(wire.KINDS) == sorted(["HELLO", "WELCOME", "OPS", "STEP", "HIDDEN", "RESULT", "ERROR", "PING",
                                         "PONG", "BYE", "SAVE", "LOAD", "DONE", "SAMPLES"])


def test_over_zmq_pair_ipc(tmp_path: Path) -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        for s in (a, b):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 5000)
        endpoint = f"ipc://{tmp_path}/wire"
        a.bind(endpoint)
        b.connect(endpoint)
        big = np.arange(256 * 1024, dtype=np.float32).reshape(512, 512)  # 1 MiB: past zmq's copy threshold
        ops = [["set", 3, 0, [[0, 4], [1, 2]]], ["swap", 4, 0, 5]]
        a.send_multipart(encode(wire.OPS, {"ops": ops}), copy=False)
        a.send_multipart(encode(wire.HIDDEN, {"step": 12}, [_raw(big, "float32"), RawTensor("uint8", (0,), b"")]),
                         copy=False)
        assert decode(b.recv_multipart(copy=False)) == ("OPS", {"ops": ops}, [])
        kind, header, (t, e) = decode(b.recv_multipart(copy=False))  # zmq.Frame objects, read in place
        assert (kind, header, t.shape, e.shape) == ("HIDDEN", {"step": 12}, (512, 512), (0,))
        assert np.array_equal(np.frombuffer(t.data, np.float32).reshape(512, 512), big)
    finally:
        a.close()
        b.close()
        ctx.term()


# --- malformed input --------------------------------------------------------------------------------------

def _header(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


GOOD_T = [["float32", [2]]]
MALFORMED = {
    "no frames": ([], "at least 2 frames"),
    "kind only": ([b"STEP"], "at least 2 frames"),
    "unknown kind": ([b"NOPE", _header({})], "unknown message kind b'NOPE'"),
    "kind not ascii": ([b"\xffSTEP", _header({})], "unknown message kind"),
    "bad msgpack byte": ([b"STEP", b"\xc1"], "header is not valid msgpack"),
    "truncated msgpack": ([b"STEP", b"\x82\xa1a"], "header is not valid msgpack"),
    "trailing bytes": ([b"STEP", _header({}) + b"\x00"], "header is not valid msgpack"),
    "header a list": ([b"STEP", _header([1, 2])], "header must be a msgpack map, got list"),
    "header an int": ([b"STEP", _header(3)], "header must be a msgpack map, got int"),
    "frame missing": ([b"HIDDEN", _header({"_tensors": GOOD_T * 2}), bytes(8)], "lists 2 tensors but 1 tensor frames"),
    "frame extra": ([b"HIDDEN", _header({}), bytes(8)], "lists 0 tensors but 1 tensor frames"),
    "too few bytes": ([b"HIDDEN", _header({"_tensors": GOOD_T}), bytes(7)], "needs 8 bytes, its frame has 7"),
    "too many bytes": ([b"HIDDEN", _header({"_tensors": [["bfloat16", [3, 2]]]}), bytes(13)], "needs 12 bytes"),
    "unknown dtype": ([b"HIDDEN", _header({"_tensors": [["float64", [1]]]}), bytes(8)], "dtype 'float64'"),
    "negative dim": ([b"HIDDEN", _header({"_tensors": [["int8", [-1]]]}), b""], "non-negative ints"),
    "float dim": ([b"HIDDEN", _header({"_tensors": [["int8", [1.0]]]}), b"\x00"], "non-negative ints"),
    "spec not a pair": ([b"HIDDEN", _header({"_tensors": [["int8"]]}), b""], "is not \\[dtype, shape\\]"),
    "specs not a list": ([b"HIDDEN", _header({"_tensors": "int8"}), b""], "must be a list"),
    "hello without protocol": ([b"HELLO", _header({"stage": 0})], f"protocol None is not this side's protocol {PROTOCOL}"),
    "hello other protocol": ([b"HELLO", _header({"protocol": PROTOCOL + 1})],
                             f"protocol {PROTOCOL + 1} is not this side's protocol {PROTOCOL}"),
    "welcome other protocol": ([b"WELCOME", _header({"protocol": "1"})], "protocol '1' is not"),
    "ext type": ([b"STEP", _header({"a": msgpack.ExtType(5, b"xyz")})], "ext types are not accepted"),
    "empty ext": ([b"STEP", b"\x81\xa1a\xc7\x00\x05"], "ext types are not accepted \\(got type 5\\)"),
    "timestamp ext": ([b"STEP", _header({"a": msgpack.Timestamp(1, 0)})], "ext types are not accepted"),
    "frame not a buffer": ([b"STEP", 12], "not a contiguous buffer"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_input_raises_wire_error(case: str) -> None:
    frames, message = MALFORMED[case]
    with pytest.raises(WireError, match=message):
        decode(frames)


def test_encode_refuses_bad_input() -> None:
    with pytest.raises(WireError, match="unknown message kind 'NOPE'"):
        encode("NOPE", {})
    with pytest.raises(WireError, match="reserved"):
        encode(wire.STEP, {"_tensors": []})
    with pytest.raises(WireError, match="header must be a dict"):
        encode(wire.STEP, [1])
    with pytest.raises(WireError, match="cannot be packed"):
        encode(wire.STEP, {"x": object()})
    with pytest.raises(WireError, match="must be RawTensor"):
        encode(wire.HIDDEN, {}, [b"abcd"])
    with pytest.raises(WireError, match="needs 8 bytes, its data has 4"):
        RawTensor("float32", (2,), b"abcd")
    with pytest.raises(WireError, match="dtype 'float64'"):
        RawTensor("float64", (1,), bytes(8))
    with pytest.raises(WireError, match="non-negative ints"):
        RawTensor("int8", (True,), b"\x00")


def test_hello_carrying_other_protocol_is_refused_after_encode() -> None:
    frames = encode(wire.HELLO, {"protocol": PROTOCOL + 1, "stage": 1})  # encode keeps an explicit version
    with pytest.raises(WireError, match=f"protocol {PROTOCOL + 1} is not this side's protocol {PROTOCOL}"):
        decode(frames)


# --- no pickle --------------------------------------------------------------------------------------------

def test_pickle_payloads_are_not_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"

    class Boom:  # unpickling it would create `marker`
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    text_pickle = f"cos\nmkdir\n(V{marker}\ntR.".encode()  # the same, protocol 0
    assert not marker.exists()
    for payload in (text_pickle, pickle.dumps(Boom()), pickle.dumps({"step": 1})):
        with pytest.raises(WireError):
            decode([b"STEP", payload])
        # ...nor inside an ext type, the one msgpack slot that could carry an object.
        with pytest.raises(WireError, match="ext types are not accepted"):
            decode([b"STEP", _header({"x": msgpack.ExtType(1, payload)})])
    assert not marker.exists()

    # Pickle bytes as a plain value stay bytes; nothing in decode reaches for pickle.
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    kind, header, _ = decode(encode(wire.ERROR, {"message": "x", "blob": pickle.dumps(Boom())}))
    assert isinstance(header["blob"], bytes) and not marker.exists()
