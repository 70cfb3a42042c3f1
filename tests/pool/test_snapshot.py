"""pool/snapshot.py: names confined to the directory, the part format, and every refusal naming its reason."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest

from pool.snapshot import (FORMAT_VERSION, MAGIC, PartReader, PartWriter, SnapshotError, check_name, part_path,
                           read_tokens, snapshot_fingerprint, write_tokens)

FIELDS = {"save_id": "a1", "model_fp": "m" * 16, "config_fp": "c" * 16, "kv_dtype": "float32", "n_stages": 2}
TOKENS = [5, 17, 99, 3, 250, 41, 8, 77, 0, 2**31 - 1]


@pytest.mark.parametrize("name", ["conv1", "a.bin", "slot-0_x", "A" * 128, "x.stage", "x.stagea", "0"])
def test_good_names_are_kept(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name, why", [
    ("../x", "refused"), ("a/b", "refused"), ("..", "refused"), ("a..b", "refused"), (".hidden", "refused"),
    ("/etc/passwd", "refused"), ("a\\b", "refused"), ("a b", "refused"), ("é", "refused"), ("A" * 129, "refused"),
    ("x.stage0", "stages' parts"), ("x.stage12", "stages' parts"), ("", "non-empty"), (None, "non-empty"),
    (3, "non-empty"),
])
def test_bad_names_are_refused(name: object, why: str) -> None:
    with pytest.raises(SnapshotError, match=why):
        check_name(name)


def test_part_paths_stay_in_the_directory(tmp_path: Path) -> None:
    assert part_path(tmp_path, "c") == tmp_path / "c"
    assert part_path(tmp_path, "c", 1, "f" * 32) == tmp_path / f"c.{'f' * 32}.stage1"
    for bad in (None, "x", "../" + "f" * 29, "F" * 32):
        with pytest.raises(SnapshotError, match="not 32 hex digits"):
            part_path(tmp_path, "c", 1, bad)
    with pytest.raises(SnapshotError):
        part_path(tmp_path, "../c")


def test_fingerprint_follows_what_decides_the_bytes() -> None:
    fp = snapshot_fingerprint("auto", "auto", [[0, 2], [2, 4]])
    assert fp == snapshot_fingerprint("auto", "auto", [[0, 2], [2, 4]]) and len(fp) == 16
    assert fp != snapshot_fingerprint("auto", "int8", [[0, 2], [2, 4]])
    assert fp != snapshot_fingerprint("bfloat16", "auto", [[0, 2], [2, 4]])
    assert fp != snapshot_fingerprint("auto", "auto", [[0, 1], [1, 4]])


def test_tokens_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "conv"
    nbytes = write_tokens(path, FIELDS, TOKENS)
    assert nbytes == path.stat().st_size
    assert path.read_bytes()[:8] == MAGIC
    header, tokens, size = read_tokens(path, **FIELDS)
    assert tokens == TOKENS and size == nbytes
    assert header["part"] == "tokens" and header["n_tokens"] == len(TOKENS)
    assert header["payload_nbytes"] == 4 * len(TOKENS) and len(header["payload_sha256"]) == 64
    assert [p.name for p in tmp_path.iterdir()] == ["conv"]  # no temporary file left


def _corrupt(path: Path, offset_from_end: int | None = None, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) - offset_from_end if offset_from_end is not None else at
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, why", [
    (lambda p: _corrupt(p, offset_from_end=3), "payload hash does not match"),
    (lambda p: _corrupt(p, at=0), "bad magic"),
    (lambda p: p.write_bytes(p.read_bytes()[:8] + struct.pack("<I", FORMAT_VERSION + 1) + p.read_bytes()[12:]),
     f"format version {FORMAT_VERSION + 1}, this server reads version {FORMAT_VERSION}"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1]), "is truncated: "),
    (lambda p: p.write_bytes(p.read_bytes()[:10]), "too short for a snapshot header"),
    (lambda p: p.write_bytes(p.read_bytes()[:30]), "truncated inside its header"),
    (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "1 bytes past the payload"),
    (lambda p: p.write_bytes(p.read_bytes()[:16] + b"\xc1" * 40 + p.read_bytes()[56:]), "header is corrupt"),
    (lambda p: p.unlink(), "no such snapshot file"),
])
def test_damaged_parts_are_refused_naming_why(tmp_path: Path, damage, why: str) -> None:
    path = tmp_path / "conv"
    write_tokens(path, FIELDS, TOKENS)
    damage(path)
    with pytest.raises(SnapshotError, match=why):
        read_tokens(path, **FIELDS)


@pytest.mark.parametrize("field, value, why", [
    ("model_fp", "x" * 16, "saved from another model \\(checkpoint fingerprint m+, this server's is x+\\)"),
    ("config_fp", "y" * 16, "another dtype, kv_dtype or layer split"),
    ("n_stages", 3, "saved across 2 stages, this server has 3"),
    ("kv_dtype", "int8", "kv_dtype is 'float32' in the file, expected 'int8'"),
    ("save_id", "b2", "belongs to another save"),
])
def test_parts_of_another_model_or_config_are_refused(tmp_path: Path, field: str, value: object, why: str) -> None:
    path = tmp_path / "conv"
    write_tokens(path, FIELDS, TOKENS)
    with pytest.raises(SnapshotError, match=why):
        read_tokens(path, **{**FIELDS, field: value})


def test_a_part_streams_and_an_unfinished_one_never_appears(tmp_path: Path) -> None:
    path = tmp_path / "kv.stage0"
    pieces = [bytes(range(16)), bytearray(b"\xff" * 48), memoryview(b"abc" * 4)]
    with PartWriter(path, {**FIELDS, "part": "kv", "n_tokens": 3}, 76) as w:
        for p in pieces:
            w.write(p)
        w.finish()
    with PartReader(path) as r:
        r.expect(part="kv", **FIELDS)
        assert r.read(76) == b"".join(bytes(p) for p in pieces)
        r.verify()
    with pytest.raises(RuntimeError):
        with PartWriter(tmp_path / "half", FIELDS, 10) as w:
            w.write(b"12345")
            raise RuntimeError("the stage failed mid-write")
    with pytest.raises(ValueError, match="5 payload bytes written, the header promises 10"):
        with PartWriter(tmp_path / "short", FIELDS, 10) as w:
            w.write(b"12345")
            w.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.stage0"]
