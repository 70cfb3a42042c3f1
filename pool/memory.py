"""A stage's share of the KV pool: one shared-memory file, mapped once (no torch here).

The file holds a header and, for each attention layer of the stage, its K and V arrays (and for int8 the
per-cell-per-head float32 scales). The stage wraps the arrays with `torch.frombuffer` over `.buffer` at the
offsets `PoolLayout.tensor_spec` gives; the file outlives the process, so a restarted stage re-attaches it
and the conversations whose chunks the coordinator still holds keep their K/V.

File layout (little-endian; every array starts on a 64-byte boundary)::

    offset 0            header  (header_nbytes, a multiple of 64)
      0   magic           8 bytes  b"STRATAKV"
      8   format version  uint32   FORMAT_VERSION
      12  header_nbytes   uint32
      16  n_layers, n_chunks, chunk_cells, kv_heads, head_dim, data_nbytes   6 x uint64
      64  kv_dtype        16 bytes, ASCII, NUL padded
      80  session         16 bytes, ASCII, NUL padded: the coordinator session the generations belong to
      128 generations     uint64 [n_chunks + 1]   one per chunk, the trash chunk included
    header_nbytes       data    (data_nbytes)
      layer 0: K [n_chunks + 1, chunk_cells, kv_heads, head_dim]  kv_dtype
               V [n_chunks + 1, chunk_cells, kv_heads, head_dim]  kv_dtype
               K scale [n_chunks + 1, chunk_cells, kv_heads]     float32   (int8 only)
               V scale [n_chunks + 1, chunk_cells, kv_heads]     float32   (int8 only)
      layer 1: ...

Rules:
- `data_nbytes` is exactly n_layers * (n_chunks + 1) * chunk_cells * bytes_per_cell: the usable cells plus
  one trash chunk, no padding hidden between arrays. Alignment therefore comes from the sizes themselves:
  a layout whose arrays are not whole multiples of 64 bytes is refused (a chunk_cells that is a multiple of
  16 always works for float32 and for the scales).
- The header is counted apart (`header_nbytes`), so the size report of the KV proper stays exact.
- `n_layers` counts the stage's full-attention layers only (pool/layer_kinds.py); it may be 0 (a stage of
  linear-attention layers): the file is then its header alone, which still carries the chunks' generations.
- The file is sized up front (`posix_fallocate`, on tmpfs this takes the pages now rather than failing with
  SIGBUS at a later write), filled with zeros, and appears under its final name only once its header is
  written (created under a temporary name, then renamed), so an attacher never reads half a header.
- `attach` refuses a file whose magic, format version, layout or size differs from what the stage expects,
  naming the field; it never reinterprets K/V bytes of another layout.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import re
import secrets
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from pool.pin import PinError, host_register, host_unregister
from pool.runtime import open_private, pool_dir

__all__ = [
    "ALIGN", "ARRAYS", "FORMAT_VERSION", "KV_DTYPES", "MAGIC", "SCALE_DTYPE", "PinError", "PoolLayout", "PoolMemory",
    "PoolMismatch", "default_path",
]

ALIGN = 64
MAGIC = b"STRATAKV"
FORMAT_VERSION = 1
KV_DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
SCALE_DTYPE = "float32"
ARRAYS = ("k", "v", "k_scale", "v_scale")

_FIXED = struct.Struct("<8sII6Q16s")  # magic, version, header_nbytes, 6 sizes, kv_dtype
_GEN_OFFSET = 128
_SESSION = slice(80, 96)
_LAYOUT_FIELDS = ("n_layers", "n_chunks", "chunk_cells", "kv_heads", "head_dim")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class PoolMismatch(ValueError):
    """An existing pool file does not match the layout the stage expects; the message names the field."""


@dataclass(frozen=True)
class PoolLayout:
    """Geometry of one stage's pool share; every size and offset in the file follows from it."""

    n_layers: int
    n_chunks: int
    chunk_cells: int
    kv_heads: int
    head_dim: int
    kv_dtype: str

    def __post_init__(self) -> None:
        for name in _LAYOUT_FIELDS:
            value = getattr(self, name)
            least = 0 if name == "n_layers" else 1  # a stage of linear-attention layers only has no K/V arrays
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"PoolLayout.{name} must be an int >= {least}, got {value!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"PoolLayout.kv_dtype {self.kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
        for which in self.arrays:
            nbytes = self._array_nbytes(which)
            if nbytes % ALIGN:
                raise ValueError(
                    f"PoolLayout: the {which} array of a layer is {nbytes} bytes, not a multiple of {ALIGN}; "
                    f"arrays are packed without padding, so each must be to keep the next one {ALIGN}-byte "
                    f"aligned (chunk_cells={self.chunk_cells}: a multiple of 16 avoids this)"
                )

    @property
    def arrays(self) -> tuple[str, ...]:
        """The arrays each layer holds, in file order."""
        return ARRAYS if self.kv_dtype == "int8" else ARRAYS[:2]

    @property
    def cells(self) -> int:
        """Usable cells per layer (the trash chunk not counted)."""
        return self.n_chunks * self.chunk_cells

    @property
    def bytes_per_cell(self) -> int:
        """Bytes one cell takes in one layer: K and V, plus their float32 scales per head for int8."""
        kv = 2 * self.kv_heads * self.head_dim * KV_DTYPES[self.kv_dtype]
        scales = 2 * self.kv_heads * KV_DTYPES[SCALE_DTYPE] if self.kv_dtype == "int8" else 0
        return kv + scales

    @property
    def layer_nbytes(self) -> int:
        return (self.n_chunks + 1) * self.chunk_cells * self.bytes_per_cell

    @property
    def data_nbytes(self) -> int:
        """Exactly n_layers * (n_chunks + 1) * chunk_cells * bytes_per_cell."""
        return self.n_layers * self.layer_nbytes

    @property
    def header_nbytes(self) -> int:
        return _round_up(_GEN_OFFSET + 8 * (self.n_chunks + 1), ALIGN)

    @property
    def nbytes(self) -> int:
        """Size of the file: header + data."""
        return self.header_nbytes + self.data_nbytes

    def shape(self, which: str) -> tuple[int, ...]:
        rows = (self.n_chunks + 1, self.chunk_cells, self.kv_heads)
        if which in ("k", "v"):
            return (*rows, self.head_dim)
        if which in ("k_scale", "v_scale") and self.kv_dtype == "int8":
            return rows
        raise ValueError(f"PoolLayout: no {which!r} array with kv_dtype {self.kv_dtype} (have {self.arrays})")

    def _dtype(self, which: str) -> str:
        """K and V are `kv_dtype`; the int8 scales are `SCALE_DTYPE`."""
        return self.kv_dtype if which in ("k", "v") else SCALE_DTYPE

    def _array_nbytes(self, which: str) -> int:
        n = 1
        for d in self.shape(which):
            n *= d
        return n * KV_DTYPES[self._dtype(which)]

    def tensor_spec(self, layer: int, which: str) -> tuple[int, str, tuple[int, ...]]:
        """(byte offset from the start of the file, dtype name, shape) of one array of a local layer."""
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"PoolLayout: layer {layer} outside [0, {self.n_layers})")
        shape = self.shape(which)
        offset = self.header_nbytes + layer * self.layer_nbytes
        for prior in self.arrays[: self.arrays.index(which)]:
            offset += self._array_nbytes(prior)
        return offset, self._dtype(which), shape

    def describe(self) -> str:
        """One line for logs: the data size and how it is made up, and the header apart."""
        return (
            f"{self.n_layers} layers x ({self.cells} cells + {self.chunk_cells} trash) x "
            f"{self.bytes_per_cell} B/cell = {self.data_nbytes} B of {self.kv_dtype} K/V"
            f"{' + scales' if self.kv_dtype == 'int8' else ''}, header {self.header_nbytes} B"
        )

    def _header(self) -> bytes:
        return _FIXED.pack(
            MAGIC, FORMAT_VERSION, self.header_nbytes,
            self.n_layers, self.n_chunks, self.chunk_cells, self.kv_heads, self.head_dim, self.data_nbytes,
            self.kv_dtype.encode("ascii"),
        )


def default_path(name: str) -> Path:
    """Where a pool file named `name` lives: the private pool directory (pool/runtime.py: /dev/shm/strata-<uid>,
    RAM-backed, 0700)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"pool file name {name!r}: use letters, digits, '.', '_' and '-'")
    return pool_dir() / f"strata-{name}"


def _size_file(fd: int, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:  # filesystems without fallocate: sparse, pages come on first write
        os.ftruncate(fd, nbytes)


def create_mapped(path: Path, nbytes: int, header: bytes) -> tuple[int, mmap.mmap]:
    """(fd, shared writable mapping) of a fresh zero-filled private file of `nbytes` at `path` that starts with
    `header`, replacing any file there by rename (module rules): made exclusively (O_EXCL, O_NOFOLLOW, 0600) under
    a fresh name first, so nothing another user placed there is ever written, and an attacher never reads half a
    header."""
    if sys.byteorder != "little":
        raise RuntimeError("pool files are little-endian; this host is not")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = open_private(tmp, os.O_RDWR, create=True)
    try:
        _size_file(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        mm[: len(header)] = header
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd, mm


class PoolMemory:
    """One stage's pool share, mapped read-write and shared (MAP_SHARED) with any other mapper of the file.

    `.buffer` is the writable mmap of the whole file (offsets of `tensor_spec` index it directly).
    `.generations` is a uint64 memoryview over the header's per-chunk generation counters (n_chunks + 1,
    the trash chunk last); it lives in the file, so it survives a restart of the stage.
    """

    def __init__(self, path: Path, layout: PoolLayout, fd: int, mm: mmap.mmap) -> None:
        self.path = path
        self.layout = layout
        self._fd = fd
        self._mm: mmap.mmap | None = mm
        gens = memoryview(mm)[_GEN_OFFSET : _GEN_OFFSET + 8 * (layout.n_chunks + 1)]
        self._generations: memoryview | None = gens.cast("Q")
        self._pinned: list[tuple[int, int]] = []
        self._cudart: ctypes.CDLL | None = None

    @classmethod
    def create(cls, path: str | Path, layout: PoolLayout) -> PoolMemory:
        """Make a fresh zero-filled file for `layout` at `path`, replacing any file there.

        A file already at `path` is replaced by rename, never truncated in place: a process that still maps
        the old file keeps valid memory instead of taking SIGBUS. The new file is made exclusively (O_EXCL,
        O_NOFOLLOW, 0600) under a fresh name first, so nothing another user placed there is ever written.
        """
        path = Path(path)
        fd, mm = create_mapped(path, layout.nbytes, layout._header())
        return cls(path, layout, fd, mm)

    @classmethod
    def attach(cls, path: str | Path, layout: PoolLayout) -> PoolMemory:
        """Map an existing file, refusing it (PoolMismatch naming the field) unless it is exactly `layout`'s, and
        (RuntimeDirError) unless it is a regular file of this user with mode 0600, opened without following a link."""
        path = Path(path)
        fd = open_private(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < _FIXED.size:
                raise PoolMismatch(f"pool file {path}: file size is {size} bytes, too small for a header")
            fixed = _FIXED.unpack(os.pread(fd, _FIXED.size, 0))
            _check_header(path, layout, fixed, size)
            mm = mmap.mmap(fd, layout.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, layout, fd, mm)

    @property
    def buffer(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError(f"pool file {self.path} is closed")
        return self._mm

    @property
    def generations(self) -> memoryview:
        if self._generations is None:
            raise ValueError(f"pool file {self.path} is closed")
        return self._generations

    @property
    def session(self) -> str:
        """The coordinator session whose ops set `.generations` ("" in a fresh file).

        Generations are only comparable within one session (a new coordinator counts from 0 again), so a
        stage zeroes them and writes the new session here when a new coordinator says HELLO; a restarted
        stage that finds its own session here knows the generations are the ones that coordinator sent.
        """
        return bytes(self.buffer[_SESSION]).rstrip(b"\0").decode("ascii", "replace")

    @session.setter
    def session(self, value: str) -> None:
        raw = value.encode("ascii")
        if len(raw) > _SESSION.stop - _SESSION.start:
            raise ValueError(f"session id {value!r} is longer than {_SESSION.stop - _SESSION.start} bytes")
        self.buffer[_SESSION] = raw.ljust(_SESSION.stop - _SESSION.start, b"\0")

    @property
    def pinned(self) -> bool:
        return bool(self._pinned)

    def pin(self, device: int | None = None) -> bool:
        """Page-lock the whole mapping with cudaHostRegister so host<->device copies run as DMA.

        Returns False and does nothing when CUDA is not present (no libcudart, or no device); True once
        pinned (again True if already pinned). `device`, if given, is made current first so the
        registration does not create a context on device 0. The mapping is registered in pieces of at
        most 64 GiB (one registration of a larger range fails on some drivers). Raises PinError if CUDA
        is present but refuses; pieces already registered are unregistered first. The rules: pool/pin.py.
        """
        if self._pinned:
            return True
        registered = host_register(self._address, self.layout.nbytes, device, str(self.path))
        if registered is None:
            return False
        self._cudart, self._pinned = registered
        return True

    def unpin(self) -> bool:
        """Undo pin(); False (a no-op) when the mapping is not pinned, e.g. without CUDA."""
        if not self._pinned:
            return False
        assert self._cudart is not None
        host_unregister(self._cudart, self._pinned)
        self._pinned = []
        return True

    def _address(self) -> int:
        anchor = ctypes.c_char.from_buffer(self.buffer)
        try:
            return ctypes.addressof(anchor)
        finally:
            del anchor  # an export left alive would keep mmap.close() from unmapping

    def close(self) -> None:
        """Unpin, release the header view and unmap; the file stays (see unlink).

        If tensors still wrap `.buffer`, the mapping stays valid for them and is unmapped when the last
        one goes; the object itself is closed either way.
        """
        if self._mm is None:
            return
        self.unpin()
        if self._generations is not None:
            self._generations.release()
            self._generations = None
        try:
            self._mm.close()
        except BufferError:
            pass  # still exported (torch.frombuffer views): unmapped when they are collected
        self._mm = None
        os.close(self._fd)

    def unlink(self) -> None:
        """Remove the file; mappings stay valid until closed. A missing file is not an error."""
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> PoolMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_header(path: Path, layout: PoolLayout, fixed: tuple, size: int) -> None:
    magic, version, header_nbytes, *sizes, data_nbytes, kv_dtype = fixed
    if magic != MAGIC:
        raise PoolMismatch(f"pool file {path}: magic is {magic!r}, expected {MAGIC!r} (not a Strata pool file)")
    if version != FORMAT_VERSION:
        raise PoolMismatch(f"pool file {path}: format version is {version}, expected {FORMAT_VERSION}")
    have = dict(zip(_LAYOUT_FIELDS, sizes))
    have["kv_dtype"] = kv_dtype.rstrip(b"\0").decode("ascii", "replace")
    for name in (*_LAYOUT_FIELDS, "kv_dtype"):
        if have[name] != getattr(layout, name):
            raise PoolMismatch(
                f"pool file {path}: {name} is {have[name]!r} in the file, expected {getattr(layout, name)!r}"
            )
    if header_nbytes != layout.header_nbytes or data_nbytes != layout.data_nbytes:
        raise PoolMismatch(
            f"pool file {path}: header_nbytes/data_nbytes are {header_nbytes}/{data_nbytes} in the file, "
            f"expected {layout.header_nbytes}/{layout.data_nbytes}"
        )
    if size != layout.nbytes:
        raise PoolMismatch(f"pool file {path}: file size is {size} bytes, expected {layout.nbytes}")
