"""Session snapshots: one held conversation in files, so it can come back after an erase or a restart (no torch).

    <slot_save_path>/<name>                     the coordinator's part: the tokens, and the save id (a manifest)
    <slot_save_path>/<name>.<save id>.stage<i>  stage i's part of that save: the K/V of its layers, cells [0, n_tokens)

Each process writes and reads only its own part, in the one directory `engine.slot_save_path` (every process
has the same config, so the same path): stages on another host need that path mounted there too.

Every part has the same shape (little-endian):

    0     magic           8 bytes   b"STRATASN"
    8     format version  uint32    FORMAT_VERSION
    12    header_nbytes   uint32    H
    16    header          a msgpack map, H bytes
    16+H  payload         header["payload_nbytes"] bytes; its sha256 is header["payload_sha256"]

Header of every part: "part" ("tokens" | "kv"), "save_id" (the same in all parts of one save, so parts of two
saves under one name are never mixed), "model_fp" (the checkpoint's), "config_fp" (`snapshot_fingerprint`),
"kv_dtype", "n_stages", "n_tokens", "payload_nbytes", "payload_sha256". A kv part adds "stage", "layers"
([first, last)), "kv_heads", "head_dim" and "arrays" (["k", "v"], plus ["k_scale", "v_scale"] for int8).

Payloads:
    tokens   int32 [n_tokens]
    kv       for each local layer, for each of its arrays in order: cells [0, n_tokens), each cell's bytes as
             the pool holds them ([kv_heads, head_dim] of kv_dtype; [kv_heads] float32 for a scale). The
             layout does not depend on chunk_cells or the pool size: a snapshot restores into any pool.

Rules:
- Names (`check_name`): letters, digits, '.', '_' and '-', at most 128, not starting with '.', no "..", not
  ending in ".stage<N>" (the stages' parts). Nothing else is accepted, so a name never leaves the directory.
- A part is written under a temporary name made by `mkstemp` in the same directory (exclusive, 0600) and
  renamed when complete: a crash mid-save never leaves a part under its final name. Parts are opened for
  reading with O_NOFOLLOW and only as regular files; no message quotes a file's bytes.
- A save is all or nothing across processes: the stages' parts go under the new save id, beside the previous
  save's; the tokens part, written last, names the save id and so switches the snapshot to the new parts at
  once. A save that fails anywhere before that leaves the previous snapshot whole (its manifest still names
  its own parts); the parts of other save ids are removed afterwards (`other_parts`). The header goes out first with a placeholder hash of the same
  length and is rewritten once the payload is out, so K/V streams from the pool to the file without being
  gathered in memory first. No fsync: a snapshot is meant to outlive processes, not power loss.
- Reading checks, in order: magic, format version, header, the file size (truncated or with extra bytes),
  the expectations of the reader (model, config, kv dtype, ...), then the payload hash as it is read. Every
  refusal is a SnapshotError whose message says why.
- `config_fp` covers only what decides what the bytes mean (dtype, kv_dtype, the layer split); the pool size,
  `parallel`, `max_context` and the front's settings may change between save and restore.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import struct
import tempfile
from pathlib import Path
from typing import Any

import msgpack

MAGIC = b"STRATASN"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")
_PLACEHOLDER = "0" * 64  # a sha256 in hex has the same length, so the header keeps its size
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_STAGE_SUFFIX = re.compile(r"\.stage\d+$")
_SAVE_ID = re.compile(r"[0-9a-f]{32}")
_SHOWN = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_REQUIRED = {"part": str, "save_id": str, "model_fp": str, "config_fp": str, "kv_dtype": str, "n_stages": int,
             "n_tokens": int, "payload_nbytes": int, "payload_sha256": str}
_WHY = {
    "model_fp": "it was saved from another model (checkpoint fingerprint {have}, this server's is {want})",
    "config_fp": "it was saved with another dtype, kv_dtype or layer split (config fingerprint {have}, "
                 "this server's is {want})",
    "save_id": "it belongs to another save (save id {have}, the tokens part names {want})",
    "n_stages": "it was saved across {have} stages, this server has {want}",
}


class SnapshotError(ValueError):
    """A snapshot name or file that is refused; the message says why (an HTTP 400 on the front)."""


def check_name(name: Any) -> str:
    """`name` if it is a safe file name for a snapshot (see the module rules); SnapshotError otherwise."""
    if not isinstance(name, str) or not name:
        raise SnapshotError("filename must be a non-empty string")
    if not _NAME.fullmatch(name) or ".." in name:
        raise SnapshotError(f"filename {name!r} is refused: use at most 128 letters, digits, '.', '_' and '-', "
                            "not starting with '.' and without '..' or '/'")
    if _STAGE_SUFFIX.search(name):
        raise SnapshotError(f"filename {name!r} is refused: names ending in .stage<N> are the stages' parts")
    return name


def check_save_id(save_id: Any) -> str:
    """`save_id` if it is one (32 lowercase hex digits, as `uuid4().hex`); SnapshotError otherwise."""
    if not isinstance(save_id, str) or not _SAVE_ID.fullmatch(save_id):
        raise SnapshotError("the save id is not 32 hex digits (a corrupt tokens part?)")
    return save_id


def part_path(directory: str | Path, name: str, stage: int | None = None, save_id: str | None = None) -> Path:
    """The coordinator's part (`stage=None`) or stage `stage`'s part of save `save_id` of snapshot `name`."""
    check_name(name)
    if stage is None:
        return Path(directory) / name
    return Path(directory) / f"{name}.{check_save_id(save_id)}.stage{stage}"


def other_parts(directory: str | Path, name: str, stage: int, keep: str) -> list[Path]:
    """Stage `stage`'s parts of snapshot `name` that belong to a save other than `keep` (to be removed)."""
    check_name(name)
    pattern = re.compile(re.escape(name) + r"\.([0-9a-f]{32})\.stage" + str(stage))
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [Path(directory) / e for e in entries if (m := pattern.fullmatch(e)) and m.group(1) != keep]


def _shown(value: Any, quote: bool) -> str:
    """A header value fit for an error message: a number, None, or a short plain word (quoted with `quote`);
    anything else is not shown."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str) and _SHOWN.fullmatch(value):
        return repr(value) if quote else value
    return "(not shown)"


def snapshot_fingerprint(dtype: str, kv_dtype: str, layers: list[list[int]]) -> str:
    """Hash of the settings that decide what saved K/V bytes mean: the model dtype, the kv dtype, the split."""
    body = {"dtype": dtype, "kv_dtype": kv_dtype, "layers": [list(x) for x in layers]}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


class PartWriter:
    """Writes one part of `payload_nbytes` payload bytes: `write(buffer)` for each piece, then `finish()`.

    Used as a context manager, a part that was not finished is removed (its temporary file never appears
    under the final name).
    """

    def __init__(self, path: str | Path, header: dict, payload_nbytes: int) -> None:
        self.path = Path(path)
        self.header = {**header, "payload_nbytes": payload_nbytes, "payload_sha256": _PLACEHOLDER}
        self._hash = hashlib.sha256()
        self._nbytes = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)  # 0600, O_EXCL
        self._tmp = Path(tmp)
        self._file = os.fdopen(fd, "wb")
        try:
            self._file.write(self._prefix_and_header())
        except BaseException:
            self.abort()
            raise

    def _prefix_and_header(self) -> bytes:
        packed = msgpack.packb(self.header, use_bin_type=True)
        return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(packed)) + packed

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._file.write(view)
        self._nbytes += view.nbytes

    def finish(self) -> int:
        """Rewrite the header with the payload's hash, close, rename into place; returns the part's bytes."""
        if self._nbytes != self.header["payload_nbytes"]:
            raise ValueError(f"{self.path.name}: {self._nbytes} payload bytes written, "
                             f"the header promises {self.header['payload_nbytes']}")
        self.header["payload_sha256"] = self._hash.hexdigest()
        final = self._prefix_and_header()  # as long as the first one: only the hash's hex digits changed
        self._file.seek(0)
        self._file.write(final)
        self._file.close()
        os.replace(self._tmp, self.path)
        return len(final) + self._nbytes

    def abort(self) -> None:
        """Drop the unfinished part: the temporary file goes even when closing it fails (a full disk)."""
        try:
            if not self._file.closed:
                self._file.close()
        except OSError:
            pass
        finally:
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None or self._tmp.exists():
            self.abort()


class PartReader:
    """Opens one part and checks everything but the hash; `read_into` then streams the payload, and `verify()`
    (after the last byte) compares the hash. `nbytes` is the size of the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        name = self.path.name
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SnapshotError(f"{name}: no such snapshot file") from None
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise SnapshotError(f"{name} is a symlink; snapshots are read only from regular files") from None
            raise SnapshotError(f"{name}: cannot be read ({os.strerror(err.errno)})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise SnapshotError(f"{name} is not a regular file")
        self._file = os.fdopen(fd, "rb")
        try:
            self.header, offset = self._read_header(name)
            self.nbytes = os.fstat(self._file.fileno()).st_size
            want = offset + self.header["payload_nbytes"]
            if self.nbytes < want:
                raise SnapshotError(f"{name} is truncated: {self.nbytes} bytes, its header promises {want}")
            if self.nbytes > want:
                raise SnapshotError(f"{name} has {self.nbytes - want} bytes past the payload its header promises")
        except BaseException:
            self._file.close()
            raise
        self._hash = hashlib.sha256()
        self._read = 0

    def _read_header(self, name: str) -> tuple[dict, int]:
        prefix = self._file.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise SnapshotError(f"{name} is truncated: {len(prefix)} bytes, too short for a snapshot header")
        magic, version, header_nbytes = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise SnapshotError(f"{name}: bad magic, not a Strata snapshot (expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise SnapshotError(f"{name}: format version {version}, this server reads version {FORMAT_VERSION}")
        raw = self._file.read(header_nbytes)
        if len(raw) < header_nbytes:
            raise SnapshotError(f"{name} is truncated inside its header")
        try:
            header = msgpack.unpackb(raw, raw=False, strict_map_key=False, max_ext_len=0)
        except Exception as err:  # noqa: BLE001 - msgpack raises several types; all mean a corrupt header
            raise SnapshotError(f"{name}: the header is corrupt ({type(err).__name__})") from None
        if not isinstance(header, dict):
            raise SnapshotError(f"{name}: the header is corrupt (not a map)")
        for key, kind in _REQUIRED.items():
            if not isinstance(header.get(key), kind) or isinstance(header.get(key), bool):
                raise SnapshotError(f"{name}: the header is corrupt ({key} is missing or not a {kind.__name__})")
        return header, _PREFIX.size + header_nbytes

    def expect(self, **want: Any) -> None:
        """SnapshotError naming the first header field that differs from `want` (in the order given)."""
        for key, value in want.items():
            have = self.header.get(key)
            if have != value:
                quote = key not in _WHY
                why = _WHY.get(key, "{key} is {have} in the file, expected {want}")
                raise SnapshotError(f"{self.path.name}: refused, " + why.format(key=key, have=_shown(have, quote),
                                                                                 want=_shown(value, quote)))

    def read_into(self, buffer: Any) -> None:
        """Fill `buffer` (writable, C-contiguous) with the next payload bytes."""
        view = memoryview(buffer).cast("B")
        got = self._file.readinto(view)
        if got != view.nbytes:
            raise SnapshotError(f"{self.path.name} is truncated (it changed while being read)")
        self._hash.update(view)
        self._read += got

    def read(self, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        self.read_into(buf)
        return bytes(buf)

    def verify(self) -> None:
        """After the whole payload: SnapshotError unless its sha256 is the header's."""
        if self._read != self.header["payload_nbytes"]:
            raise ValueError(f"{self.path.name}: {self._read} of {self.header['payload_nbytes']} payload bytes read")
        if self._hash.hexdigest() != self.header["payload_sha256"]:
            raise SnapshotError(f"{self.path.name}: the payload hash does not match its header (the file is corrupt)")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> PartReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_tokens(path: str | Path, header: dict, tokens: list[int]) -> int:
    """Write the coordinator's part (payload int32 tokens); returns the file's bytes."""
    payload = struct.pack(f"<{len(tokens)}i", *tokens)
    with PartWriter(path, {**header, "part": "tokens", "n_tokens": len(tokens)}, len(payload)) as w:
        w.write(payload)
        return w.finish()


def read_tokens(path: str | Path, **want: Any) -> tuple[dict, list[int], int]:
    """(header, tokens, file bytes) of a coordinator's part, checked against `want` and its hash."""
    with PartReader(path) as r:
        r.expect(part="tokens", **want)
        n = r.header["n_tokens"]
        if r.header["payload_nbytes"] != 4 * n:
            raise SnapshotError(f"{r.path.name}: the header is corrupt ({n} tokens in "
                                f"{r.header['payload_nbytes']} bytes)")
        tokens = list(struct.unpack(f"<{n}i", r.read(4 * n)))
        r.verify()
        return r.header, tokens, r.nbytes
