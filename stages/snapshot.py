"""A stage's part of a session snapshot: the K/V of its layers for one table's cells (and, on a stage with
linear-attention layers, the table's state entry), to and from a file.

The file format and its checks are `pool/snapshot.py`'s; this module only moves bytes between the pool arrays
and the file. Cells are read and written through the table's entries one chunk at a time: within a chunk the
cells of one array are contiguous (`arr[chunk, :m]`), so on a CPU stage each piece goes between the pool file's
mapping and the snapshot file without a copy in between; a CUDA stage stages each piece through host memory.

    payload = for layer in local layers: for array in kv.arrays of that layer ("k", "v"[, "k_scale", "v_scale"]):
                  arr[entries[0], :C] | arr[entries[1], :C] | ... | arr[entries[last], :m]    (cells [0, cells))
              [| state.conv[e] | state.recurrent[e]]      a stage with linear-attention layers: entry e's state

A state cannot be cut (stages/state_pool.py): a part holds a state entry only when it holds exactly `cells`
tokens, and reading a part sets the entry to hold them once the hash is checked (UNKNOWN until then).
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from pool.snapshot import PartReader, PartWriter, SnapshotError

from .kv_cache import KVCache
from .state_pool import UNKNOWN, StatePool

READ_BLOCK = 1 << 22  # bytes per read when only checking a part's hash


def arrays_of(kv: KVCache) -> list[str]:
    """The arrays each layer saves, in payload order."""
    return ["k", "v", "k_scale", "v_scale"] if kv.quantized else ["k", "v"]


def _pieces(kv: KVCache, entries: list[int], cells: int, state: tuple[StatePool, int] | None = None
            ) -> Iterator[torch.Tensor]:
    """Views of the pool arrays holding cells [0, cells) of the table `entries`, then `state`'s entry (pool,
    entry), in payload order."""
    c = kv.chunk_cells
    if cells > len(entries) * c:
        raise ValueError(f"{cells} cells do not fit a table of {len(entries)} chunks of {c} cells")
    runs = [(entries[j], min(c, cells - j * c)) for j in range(-(-cells // c))]
    if any(chunk == kv.trash for chunk, _ in runs):
        raise ValueError(f"cells [0, {cells}) of this table reach the trash chunk: they are not reserved")
    for layer in range(kv.n_layers):
        for which in arrays_of(kv):
            arr = getattr(kv, which)[layer]
            for chunk, m in runs:
                yield arr[chunk, :m]
    if state is not None:
        pool, e = state
        yield pool.conv[e]
        yield pool.recurrent[e]


def _bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def payload_nbytes(kv: KVCache, cells: int, state: tuple[StatePool, int] | None = None) -> int:
    return cells * kv.bytes_per_cell + (state[0].entry_nbytes if state is not None else 0)


def save_part(kv: KVCache, entries: list[int], cells: int, path: str | Path, header: dict,
              state: tuple[StatePool, int] | None = None) -> int:
    """Write cells [0, cells) of the table `entries` (and `state`'s entry, which must hold exactly those
    tokens) to `path` (atomically); returns the file's bytes."""
    if state is not None and state[0].tokens[state[1]] != cells:
        held = state[0].tokens[state[1]]
        what = "no valid state" if held == UNKNOWN else f"the state after {held} tokens"
        raise SnapshotError(f"state entry {state[1]} holds {what}, not that of the {cells} tokens to save")
    with PartWriter(path, {**header, "part": "kv", "n_tokens": cells}, payload_nbytes(kv, cells, state)) as w:
        for piece in _pieces(kv, entries, cells, state):
            w.write(_bytes(piece if piece.device.type == "cpu" else piece.cpu()))
        return w.finish()


def open_part(kv: KVCache, path: str | Path, cells: int, expect: dict,
              state: tuple[StatePool, int] | None = None) -> PartReader:
    """Open a part and check its header against `expect` and this stage's geometry (not yet the hash)."""
    reader = PartReader(path)
    try:
        reader.expect(part="kv", **expect, n_tokens=cells)  # which save first: its message says more
        if reader.header["payload_nbytes"] != payload_nbytes(kv, cells, state):
            extra = f" and a state entry of {state[0].entry_nbytes} bytes" if state is not None else ""
            raise SnapshotError(f"{reader.path.name}: the header is corrupt ({reader.header['payload_nbytes']} "
                                f"payload bytes for {cells} cells of {kv.bytes_per_cell} bytes{extra})")
    except BaseException:
        reader.close()
        raise
    return reader


def check_part(kv: KVCache, path: str | Path, cells: int, expect: dict,
               state: tuple[StatePool, int] | None = None) -> int:
    """Read a whole part without writing anything: header, geometry, size and hash; returns the file's bytes."""
    with open_part(kv, path, cells, expect, state) as reader:
        left = reader.header["payload_nbytes"]
        block = bytearray(min(READ_BLOCK, max(left, 1)))
        while left:
            n = min(left, len(block))
            reader.read_into(memoryview(block)[:n])
            left -= n
        reader.verify()
        return reader.nbytes


def load_part(kv: KVCache, entries: list[int], cells: int, path: str | Path, expect: dict,
              state: tuple[StatePool, int] | None = None) -> int:
    """Read a part into cells [0, cells) of the table `entries` (and `state`'s entry); returns the file's bytes.

    The hash is checked once every byte is in place: on a SnapshotError the cells hold garbage, and the caller
    must give them back (the coordinator restores into chunks nobody else holds, and releases them); the state
    entry holds no valid state until the hash is checked.
    """
    with open_part(kv, path, cells, expect, state) as reader:
        if state is not None:
            state[0].tokens[state[1]] = UNKNOWN
        for piece in _pieces(kv, entries, cells, state):
            if piece.device.type == "cpu":
                reader.read_into(_bytes(piece))
            else:
                host = torch.empty(piece.shape, dtype=piece.dtype)
                reader.read_into(_bytes(host))
                piece.copy_(host)
        reader.verify()
        if state is not None:
            state[0].tokens[state[1]] = cells
        return reader.nbytes
