"""A stage's K/V arrays over the pool's chunks, and every slot's chunk table at a fixed device address.

Layout, per local attention layer l (C = chunk_cells, N = n_chunks; chunk N is the trash chunk):

    k[l], v[l]              [N + 1, C, kv_heads, head_dim]   kv dtype (model dtype, or int8)
    k_scale[l], v_scale[l]  [N + 1, C, kv_heads]             float32, int8 only: value = int8 * scale,
                                                             scale = absmax over head_dim / 127 (per cell, head)
    tables                  int32 [n_slots, table_chunks]    logical chunk j of slot s lives in pool chunk
                                                             tables[s, j]; cell p at (tables[s, p // C], p % C)

The tables are allocated once and only ever updated in place (`set_table` copies into the existing rows):
captured CUDA graphs bake their address in. `host_tables` holds the same rows as Python lists; change the
tables only through `set_table` and `clear_tables`, which keep both. Every entry starts at the trash chunk, so a write through an
unreserved entry lands in the trash, never in another conversation's cells.

`storage(layer, which, dtype, shape) -> tensor` lets the stage place each array elsewhere, e.g. a
`torch.frombuffer` view of its shared-memory pool file (`which` is "k", "v", "k_scale" or "v_scale",
`dtype` a torch dtype); by default arrays are zeros on `device`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

Storage = Callable[[int, str, torch.dtype, tuple[int, ...]], torch.Tensor]

KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
}


def kv_dtype_name(kv_dtype: str | torch.dtype) -> str:
    """Normalise a kv dtype given as a name or a torch dtype to its name in `KV_DTYPES`."""
    for name, dt in KV_DTYPES.items():
        if kv_dtype == name or kv_dtype == dt:
            return name
    raise ValueError(f"kv dtype {kv_dtype!r} is not supported; supported: {', '.join(KV_DTYPES)}")


class KVCache:
    """K/V arrays (`.k`, `.v`, and for int8 `.k_scale`, `.v_scale`) per local layer, plus `.tables`."""

    def __init__(
        self,
        n_layers: int,
        n_chunks: int,
        chunk_cells: int,
        kv_heads: int,
        head_dim: int,
        kv_dtype: str | torch.dtype,
        device: torch.device | str,
        n_slots: int,
        table_chunks: int,
        storage: Storage | None = None,
    ) -> None:
        self.n_layers, self.n_chunks, self.chunk_cells = n_layers, n_chunks, chunk_cells
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.n_slots, self.table_chunks = n_slots, table_chunks
        self.device = torch.device(device)
        self.kv_dtype = kv_dtype_name(kv_dtype)
        self.dtype = KV_DTYPES[self.kv_dtype]
        self.quantized = self.kv_dtype == "int8"
        shape = (n_chunks + 1, chunk_cells, kv_heads, head_dim)
        scale_shape = (n_chunks + 1, chunk_cells, kv_heads)
        alloc = self._allocator(storage)
        self.k = [alloc(layer, "k", self.dtype, shape) for layer in range(n_layers)]
        self.v = [alloc(layer, "v", self.dtype, shape) for layer in range(n_layers)]
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        if self.quantized:
            self.k_scale = [alloc(layer, "k_scale", torch.float32, scale_shape) for layer in range(n_layers)]
            self.v_scale = [alloc(layer, "v_scale", torch.float32, scale_shape) for layer in range(n_layers)]
        self.tables = torch.full((n_slots, table_chunks), n_chunks, dtype=torch.int32, device=self.device)
        # The same rows on the host, kept by `set_table` / `clear_tables`: attention plans its reads (which
        # chunks, whether they are consecutive) from these without reading device memory.
        self.host_tables: list[list[int]] = [[n_chunks] * table_chunks for _ in range(n_slots)]
        self._scratch: dict[str, torch.Tensor] = {}

    @property
    def trash(self) -> int:
        return self.n_chunks

    @property
    def bytes_per_cell(self) -> int:
        """Bytes one cell takes in all local layers (K and V, plus scales for int8)."""
        per_layer = 2 * self.kv_heads * self.head_dim * self.dtype.itemsize
        if self.quantized:
            per_layer += 2 * self.kv_heads * 4
        return per_layer * self.n_layers

    def arrays(self) -> list[torch.Tensor]:
        """Every array of every layer: K, V, then the scales when int8."""
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]

    def set_table(self, slot: int, entries: Sequence[int]) -> None:
        """Copy a slot's `table_chunks` entries into its fixed row (in place: the address never changes)."""
        if len(entries) != self.table_chunks:
            raise ValueError(f"slot {slot}: table has {len(entries)} entries, expected {self.table_chunks}")
        row = torch.as_tensor(list(entries), dtype=torch.int32)
        if int(row.min()) < 0 or int(row.max()) > self.n_chunks:
            raise ValueError(f"slot {slot}: table entries must lie in [0, {self.n_chunks}] (trash = {self.n_chunks})")
        self.tables[slot].copy_(row)
        self.host_tables[slot] = row.tolist()

    def clear_tables(self) -> None:
        """Point every entry of every slot at the trash chunk (in place)."""
        self.tables.fill_(self.n_chunks)
        self.host_tables = [[self.n_chunks] * self.table_chunks for _ in range(self.n_slots)]

    def scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `shape` on the device, the same memory on every call with this `name` (grown when
        too small): for values that live only until the next call, e.g. one layer's gathered context."""
        numel = 1
        for d in shape:
            numel *= d
        buf = self._scratch.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = self._scratch[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)

    def copy_cells(self, src_entries: Sequence[int], dst_entries: Sequence[int], cells: int) -> None:
        """Copy cells [0, cells) of the table `src_entries` into the table `dst_entries`, in every array.

        The pool-off baseline moves a conversation this way (bytes copied); with the pool a move is a table
        swap and no byte moves.
        """
        src, dst = self._cell_index(src_entries, cells), self._cell_index(dst_entries, cells)
        for arr in self.arrays():
            flat = arr.view(-1, *arr.shape[2:])
            flat.index_copy_(0, dst, flat.index_select(0, src))

    def exchange(self, a_entries: Sequence[int], b_entries: Sequence[int], cells: int) -> None:
        """Swap cells [0, cells) between the tables `a_entries` and `b_entries`, in every array (a byte swap)."""
        a, b = self._cell_index(a_entries, cells), self._cell_index(b_entries, cells)
        for arr in self.arrays():
            flat = arr.view(-1, *arr.shape[2:])
            a_bytes = flat.index_select(0, a)
            flat.index_copy_(0, a, flat.index_select(0, b))
            flat.index_copy_(0, b, a_bytes)

    def _cell_index(self, entries: Sequence[int], cells: int) -> torch.Tensor:
        """Flat cell numbers (chunk * C + offset) of cells [0, cells) of a table."""
        c = self.chunk_cells
        if cells > len(entries) * c:
            raise ValueError(f"{cells} cells do not fit a table of {len(entries)} chunks of {c} cells")
        pos = torch.arange(cells)
        chunks = torch.as_tensor(list(entries), dtype=torch.int64)[pos // c]
        return (chunks * c + pos % c).to(self.device)

    def _allocator(self, storage: Storage | None) -> Storage:
        def zeros(layer: int, which: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        if storage is None:
            return zeros

        def checked(layer: int, which: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            t = storage(layer, which, dtype, shape)
            on_device = t.device.type == self.device.type and self.device.index in (None, t.device.index)
            if tuple(t.shape) != shape or t.dtype != dtype or not on_device or not t.is_contiguous():
                raise ValueError(
                    f"storage for layer {layer} {which}: got {t.dtype} {tuple(t.shape)} on {t.device} "
                    f"(contiguous={t.is_contiguous()}), expected contiguous {dtype} {shape} on {self.device}"
                )
            return t

        return checked
