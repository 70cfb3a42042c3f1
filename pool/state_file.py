"""A stage's linear-attention state entries in a shared-memory file beside its pool file (no torch here).

The pool file (pool/memory.py) holds a stage's K/V; a stage with linear-attention layers keeps its state entries
(stages/state_pool.py) in this second file, `<pool file>.state`, so that a stage restarted after a crash finds
the state of every conversation it held, as it finds their K/V. The stage wraps the arrays with
`torch.frombuffer` at the offsets `StateLayout.spec` gives.

File layout (little-endian; both arrays start on a 64-byte boundary)::

    offset 0            header  (header_nbytes, a multiple of 64)
      0   magic           8 bytes  b"STRATAST"
      8   format version  uint32   FORMAT_VERSION
      12  header_nbytes   uint32
      16  n_entries, n_layers, conv_rows, conv_dim, value_heads, key_dim, value_dim, data_nbytes   8 x uint64
      80  conv_dtype      16 bytes, ASCII, NUL padded
      96  session         16 bytes, ASCII, NUL padded: the coordinator session the entries belong to
      128 tokens          int64 [n_entries]   tokens each entry's state holds; -1: not that of a known prefix
    header_nbytes       data    (data_nbytes)
      conv       [n_entries, n_layers, conv_rows, conv_dim]              conv_dtype, padded to 64 bytes
      recurrent  [n_entries, n_layers, value_heads, key_dim, value_dim]  float32

Rules:
1. The tokens live in the file with the arrays: a stage writes -1 before it changes an entry and the new count
   once the change is whole (stages/state_pool.py rules 2 and 4), so a stage that dies mid-step leaves the
   entries it was writing unknown, never a count that does not describe the bytes.
2. `session` says which coordinator session the counts belong to; a stage whose coordinator session differs
   forgets every entry (all -1) and writes the new session (stages/runner.py `reset`).
3. Created and attached as the pool file is (pool/memory.py): exclusively under a fresh name then renamed, a
   private 0600 file of this user opened without following a link, under the same lock; `attach` refuses a file
   whose magic, version, geometry, dtype or size differs, naming the field (the stage then makes a fresh one:
   every entry holds the state after 0 tokens).
4. Only a stage whose state lives in host memory keeps it here (CPU). A CUDA stage's entries are device memory,
   gone with the process; keeping them here would add a device-to-host copy of each row's whole entry to every
   step, so a restarted CUDA stage keeps no state (coordinator/linear_state.py rule 3).
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from pool.memory import ALIGN, PoolMismatch, _round_up, create_mapped
from pool.runtime import open_private

__all__ = ["FORMAT_VERSION", "MAGIC", "StateFile", "StateLayout", "UNKNOWN"]

MAGIC = b"STRATAST"
FORMAT_VERSION = 1
UNKNOWN = -1
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_FIXED = struct.Struct("<8sII8Q16s")
_SESSION = slice(96, 112)
_TOKENS = 128
_FIELDS = ("n_entries", "n_layers", "conv_rows", "conv_dim", "value_heads", "key_dim", "value_dim")


@dataclass(frozen=True)
class StateLayout:
    """Geometry of one stage's state entries; every size and offset in the file follows from it."""

    n_entries: int
    n_layers: int
    conv_rows: int
    conv_dim: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_dtype: str

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"StateLayout.{name} must be an int >= 1, got {value!r}")
        if self.conv_dtype not in DTYPE_BYTES:
            raise ValueError(f"StateLayout.conv_dtype {self.conv_dtype!r}: use one of {', '.join(DTYPE_BYTES)}")

    @property
    def conv_shape(self) -> tuple[int, ...]:
        return (self.n_entries, self.n_layers, self.conv_rows, self.conv_dim)

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        return (self.n_entries, self.n_layers, self.value_heads, self.key_dim, self.value_dim)

    @property
    def header_nbytes(self) -> int:
        return _round_up(_TOKENS + 8 * self.n_entries, ALIGN)

    @property
    def _conv_nbytes(self) -> int:
        n = DTYPE_BYTES[self.conv_dtype]
        for d in self.conv_shape:
            n *= d
        return _round_up(n, ALIGN)

    @property
    def data_nbytes(self) -> int:
        n = 4
        for d in self.recurrent_shape:
            n *= d
        return self._conv_nbytes + n

    @property
    def nbytes(self) -> int:
        return self.header_nbytes + self.data_nbytes

    def spec(self, which: str) -> tuple[int, str, tuple[int, ...]]:
        """(byte offset from the start of the file, dtype name, shape) of "conv" or "recurrent"."""
        if which == "conv":
            return self.header_nbytes, self.conv_dtype, self.conv_shape
        if which == "recurrent":
            return self.header_nbytes + self._conv_nbytes, "float32", self.recurrent_shape
        raise ValueError(f"StateLayout: no {which!r} array (have conv, recurrent)")

    def _header(self) -> bytes:
        fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, self.header_nbytes, *(getattr(self, f) for f in _FIELDS),
                            self.data_nbytes, self.conv_dtype.encode("ascii"))
        return fixed.ljust(_TOKENS, b"\0")


class StateFile:
    """One stage's state entries, mapped read-write and shared. `.buffer` is the mapping (`spec` offsets index
    it); `.tokens` an int64 memoryview of the per-entry counts (rule 1)."""

    def __init__(self, path: Path, layout: StateLayout, fd: int, mm: mmap.mmap) -> None:
        self.path, self.layout, self._fd, self._mm = path, layout, fd, mm
        self.tokens = memoryview(mm)[_TOKENS : _TOKENS + 8 * layout.n_entries].cast("q")

    @classmethod
    def create(cls, path: str | Path, layout: StateLayout) -> StateFile:
        """A fresh zero-filled file (every entry the state after 0 tokens), replacing any file there (rule 3)."""
        path = Path(path)
        fd, mm = create_mapped(path, layout.nbytes, layout._header())
        return cls(path, layout, fd, mm)

    @classmethod
    def attach(cls, path: str | Path, layout: StateLayout) -> StateFile:
        """Map an existing file, refusing it (PoolMismatch naming the field) unless it is exactly `layout`'s."""
        path = Path(path)
        fd = open_private(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < _FIXED.size:
                raise PoolMismatch(f"state file {path}: file size is {size} bytes, too small for a header")
            magic, version, header_nbytes, *sizes, data_nbytes, dtype = _FIXED.unpack(os.pread(fd, _FIXED.size, 0))
            have = {"magic": magic, "format version": version, **dict(zip(_FIELDS, sizes)),
                    "conv_dtype": dtype.rstrip(b"\0").decode("ascii", "replace"), "header_nbytes": header_nbytes,
                    "data_nbytes": data_nbytes, "file size": size}
            want = {"magic": MAGIC, "format version": FORMAT_VERSION, **{f: getattr(layout, f) for f in _FIELDS},
                    "conv_dtype": layout.conv_dtype, "header_nbytes": layout.header_nbytes,
                    "data_nbytes": layout.data_nbytes, "file size": layout.nbytes}
            for name, value in want.items():
                if have[name] != value:
                    raise PoolMismatch(f"state file {path}: {name} is {have[name]!r} in the file, expected {value!r}")
            mm = mmap.mmap(fd, layout.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, layout, fd, mm)

    @property
    def buffer(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError(f"state file {self.path} is closed")
        return self._mm

    @property
    def session(self) -> str:
        """The coordinator session the counts belong to ("" in a fresh file; rule 2)."""
        return bytes(self.buffer[_SESSION]).rstrip(b"\0").decode("ascii", "replace")

    @session.setter
    def session(self, value: str) -> None:
        raw = value.encode("ascii")
        if len(raw) > _SESSION.stop - _SESSION.start:
            raise ValueError(f"session id {value!r} is longer than {_SESSION.stop - _SESSION.start} bytes")
        self.buffer[_SESSION] = raw.ljust(_SESSION.stop - _SESSION.start, b"\0")

    def close(self) -> None:
        """Release the views and unmap (tensors still wrapping the buffer keep it mapped until collected)."""
        if self._mm is None:
            return
        self.tokens.release()
        try:
            self._mm.close()
        except BufferError:
            pass
        self._mm = None
        os.close(self._fd)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)
