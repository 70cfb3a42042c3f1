"""pool/memory.py: byte accounting, the file shared between processes, attach checks, generations.

Pinning: test_pin.py."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pool.memory import PoolLayout, PoolMemory, PoolMismatch, default_path

REPO = Path(__file__).resolve().parents[2]
# numpy has no bfloat16: its cells are read and written as raw 16-bit words.
NP_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int8": "i1"}


def _array(mem: PoolMemory, layer: int, which: str) -> np.ndarray:
    offset, dtype, shape = mem.layout.tensor_spec(layer, which)
    count = int(np.prod(shape))
    return np.frombuffer(mem.buffer, dtype=NP_DTYPES[dtype], count=count, offset=offset).reshape(shape)


def _run_child(code: str, *args: str) -> dict:
    """Run `code` in a fresh interpreter (a second process mapping the same file); it prints one JSON line."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def pool_path(tmp_path: Path) -> Path:
    return tmp_path / "pool-share"


# --- bytes accounting -----------------------------------------------------------------------------------

# 3 layers, 5 usable chunks + 1 trash, 16 cells per chunk, 2 kv heads of 8: 96 cells per layer in the file.
EXPECTED = {  # kv_dtype -> (bytes_per_cell, data_nbytes) worked out by hand
    "float32": (2 * 2 * 8 * 4, 3 * 6 * 16 * 128),
    "bfloat16": (2 * 2 * 8 * 2, 3 * 6 * 16 * 64),
    "float16": (2 * 2 * 8 * 2, 3 * 6 * 16 * 64),
    "int8": (2 * 2 * 8 * 1 + 2 * 2 * 4, 3 * 6 * 16 * 48),  # K, V int8 + K, V float32 scale per head
}


@pytest.mark.parametrize("kv_dtype", list(EXPECTED))
def test_bytes_accounting_is_exact(kv_dtype: str, pool_path: Path) -> None:
    layout = PoolLayout(n_layers=3, n_chunks=5, chunk_cells=16, kv_heads=2, head_dim=8, kv_dtype=kv_dtype)
    bytes_per_cell, data_nbytes = EXPECTED[kv_dtype]
    assert layout.bytes_per_cell == bytes_per_cell
    assert layout.data_nbytes == data_nbytes
    assert layout.header_nbytes == 192  # 128 fixed + 6 generations of 8 bytes, rounded up to 64
    assert layout.nbytes == 192 + data_nbytes
    assert layout.cells == 80

    # The arrays tile the data region in file order: no gap, no overlap, each 64-byte aligned.
    cursor = layout.header_nbytes
    for layer in range(3):
        for which in layout.arrays:
            offset, dtype, shape = layout.tensor_spec(layer, which)
            assert offset == cursor and offset % 64 == 0
            assert shape[:3] == (6, 16, 2)
            cursor += int(np.prod(shape)) * {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}[dtype]
    assert cursor == layout.nbytes
    assert layout.arrays == (("k", "v", "k_scale", "v_scale") if kv_dtype == "int8" else ("k", "v"))

    with PoolMemory.create(pool_path, layout) as mem:
        st = os.stat(pool_path)
        assert st.st_size == layout.nbytes == len(mem.buffer)
        assert st.st_blocks * 512 >= layout.nbytes  # allocated up front, not sparse
        assert not any(mem.buffer[layout.header_nbytes :])  # zero filled


def test_scale_arrays_only_for_int8() -> None:
    layout = PoolLayout(1, 2, 16, 1, 8, "bfloat16")
    with pytest.raises(ValueError, match="no 'k_scale' array with kv_dtype bfloat16"):
        layout.tensor_spec(0, "k_scale")
    assert PoolLayout(1, 2, 16, 1, 8, "int8").tensor_spec(0, "v_scale")[1:] == ("float32", (3, 16, 1))
    with pytest.raises(IndexError, match="layer 1 outside"):
        layout.tensor_spec(1, "k")


@pytest.mark.parametrize(
    "args, message",
    [  # (n_layers, n_chunks, chunk_cells, kv_heads, head_dim, kv_dtype)
        ((1, 2, 4, 1, 2, "int8"), "k array of a layer is 24"),
        ((1, 2, 4, 1, 16, "int8"), "k_scale array of a layer is 48"),
        ((1, 2, 16, 1, 8, "float64"), "kv_dtype 'float64'"),
        ((-1, 2, 16, 1, 8, "float32"), "n_layers must be"),
        ((1, 0, 16, 1, 8, "float32"), "n_chunks must be"),
    ],
)
def test_bad_layouts_refused(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PoolLayout(*args)


# --- one file, two processes ------------------------------------------------------------------------------

LAYOUT_ARGS = dict(n_layers=2, n_chunks=6, chunk_cells=16, kv_heads=2, head_dim=4)
TABLE = [4, 1, 5]  # logical chunk -> pool chunk; cells [0, 40) are written
CELLS = 40

# The pattern both processes compute: distinct per layer, cell, head and dim, non-zero, exact in every dtype.
PATTERN_SRC = """
def pattern(layer, p, h, d):
    return (layer * 7 + p * 3 + h * 5 + d) % 97 + 1
"""

CHILD = PATTERN_SRC + """
import json, sys
import numpy as np
from pool.memory import PoolLayout, PoolMemory
NP = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int8": "i1"}
path, layout_json, table_json, cells = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
layout, table = PoolLayout(**json.loads(layout_json)), json.loads(table_json)
mem = PoolMemory.attach(path, layout)
C = layout.chunk_cells
def arr(layer, which):
    off, dt, shape = layout.tensor_spec(layer, which)
    return np.frombuffer(mem.buffer, dtype=NP[dt], count=int(np.prod(shape)), offset=off).reshape(shape)
bad = 0
for layer in range(layout.n_layers):
    k, v = arr(layer, "k"), arr(layer, "v")
    for p in range(cells):
        chunk, off = table[p // C], p % C
        for h in range(layout.kv_heads):
            for d in range(layout.head_dim):
                bad += int(k[chunk, off, h, d] != pattern(layer, p, h, d))
                v[chunk, off, h, d] = pattern(layer, p, h, d) + 1
        if layout.kv_dtype == "int8":
            bad += int(arr(layer, "k_scale")[chunk, off, 0] != p + 0.5)
gens = [int(g) for g in mem.generations]
mem.generations[table[0]] += 10
del k, v
mem.close()
print(json.dumps({"bad": bad, "generations": gens}))
"""
exec(PATTERN_SRC)  # defines pattern() here too


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "int8"])
def test_pattern_through_table_read_back_in_second_process(kv_dtype: str, pool_path: Path) -> None:
    layout = PoolLayout(**LAYOUT_ARGS, kv_dtype=kv_dtype)
    C = layout.chunk_cells
    with PoolMemory.create(pool_path, layout) as mem:
        for chunk in TABLE:
            mem.generations[chunk] = chunk + 100
        for layer in range(layout.n_layers):
            k = _array(mem, layer, "k")
            for p in range(CELLS):
                chunk, off = TABLE[p // C], p % C  # cell p of the table lives at chunk table[p // C], p % C
                for h in range(layout.kv_heads):
                    for d in range(layout.head_dim):
                        k[chunk, off, h, d] = pattern(layer, p, h, d)
                if kv_dtype == "int8":
                    _array(mem, layer, "k_scale")[chunk, off, :] = p + 0.5
        del k

        child = _run_child(CHILD, str(pool_path), json.dumps(layout.__dict__), json.dumps(TABLE), str(CELLS))
        assert child["bad"] == 0
        assert child["generations"] == [0, 101, 0, 0, 104, 105, 0]  # chunks 0..5 + trash

        # The child's writes are visible here, through the same table; nothing outside the table was touched.
        assert mem.generations[TABLE[0]] == 114
        for layer in range(layout.n_layers):
            k, v = _array(mem, layer, "k"), _array(mem, layer, "v")
            for p in range(CELLS):
                chunk, off = TABLE[p // C], p % C
                want = [[pattern(layer, p, h, d) + 1 for d in range(layout.head_dim)] for h in range(layout.kv_heads)]
                assert v[chunk, off].tolist() == want
            untouched = [c for c in range(layout.n_chunks + 1) if c not in TABLE]  # includes the trash chunk
            assert not k[untouched].any() and not v[untouched].any()
            assert not k[TABLE[2], CELLS % C :].any()  # the tail of the last chunk, past cell 40
            del k, v


# --- attach checks ------------------------------------------------------------------------------------------

BASE = PoolLayout(n_layers=2, n_chunks=6, chunk_cells=16, kv_heads=2, head_dim=8, kv_dtype="float16")


@pytest.mark.parametrize(
    "field, value",
    [("n_layers", 3), ("n_chunks", 7), ("chunk_cells", 32), ("kv_heads", 4), ("head_dim", 16),
     ("kv_dtype", "bfloat16")],
)
def test_attach_refuses_other_layout_naming_the_field(field: str, value: object, pool_path: Path) -> None:
    PoolMemory.create(pool_path, BASE).close()
    other = PoolLayout(**{**BASE.__dict__, field: value})
    with pytest.raises(PoolMismatch, match=f"{field} is {getattr(BASE, field)!r} in the file, expected {value!r}"):
        PoolMemory.attach(pool_path, other)
    PoolMemory.attach(pool_path, BASE).close()  # the file itself is fine


def test_attach_refuses_bad_magic_version_and_size(pool_path: Path) -> None:
    PoolMemory.create(pool_path, BASE).close()
    with open(pool_path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 2))
    with pytest.raises(PoolMismatch, match="format version is 2, expected 1"):
        PoolMemory.attach(pool_path, BASE)
    with open(pool_path, "r+b") as f:
        f.write(b"NOTAPOOL")
    with pytest.raises(PoolMismatch, match="magic is b'NOTAPOOL'"):
        PoolMemory.attach(pool_path, BASE)

    PoolMemory.create(pool_path, BASE).close()
    os.truncate(pool_path, BASE.nbytes - 64)
    with pytest.raises(PoolMismatch, match=f"file size is {BASE.nbytes - 64} bytes, expected {BASE.nbytes}"):
        PoolMemory.attach(pool_path, BASE)
    with pytest.raises(FileNotFoundError):
        PoolMemory.attach(pool_path.with_name("absent"), BASE)


def test_generations_persist_across_attach(pool_path: Path) -> None:
    with PoolMemory.create(pool_path, BASE) as mem:
        assert len(mem.generations) == BASE.n_chunks + 1 and not any(mem.generations)
        mem.generations[0], mem.generations[5] = 3, 2**64 - 1
    with PoolMemory.attach(pool_path, BASE) as mem:
        assert list(mem.generations) == [3, 0, 0, 0, 0, 2**64 - 1, 0]
        mem.generations[6] = 1
    code = (
        "import json, sys\nfrom pool.memory import PoolLayout, PoolMemory\n"
        "with PoolMemory.attach(sys.argv[1], PoolLayout(**json.loads(sys.argv[2]))) as m:\n"
        "    print(json.dumps(list(m.generations)))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code, str(pool_path), json.dumps(BASE.__dict__)],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == [3, 0, 0, 0, 0, 2**64 - 1, 1]


def test_create_replaces_without_breaking_an_old_mapping(pool_path: Path) -> None:
    old = PoolMemory.create(pool_path, BASE)
    old.buffer[BASE.header_nbytes] = 0x5A
    new = PoolMemory.create(pool_path, BASE)
    assert new.buffer[BASE.header_nbytes] == 0
    assert old.buffer[-1] == 0 and old.buffer[BASE.header_nbytes] == 0x5A  # still mapped, no SIGBUS
    assert [p.name for p in pool_path.parent.iterdir()] == [pool_path.name]  # no temp file left
    old.close()
    new.close()


def test_close_unlink_and_context_manager(pool_path: Path) -> None:
    with PoolMemory.create(pool_path, BASE) as mem:
        view = np.frombuffer(mem.buffer, dtype=np.uint8)  # an outside view still alive at close
    with pytest.raises(ValueError, match="is closed"):
        mem.buffer
    with pytest.raises(ValueError, match="is closed"):
        mem.generations
    assert view[:8].tobytes() == b"STRATAKV"  # the mapping outlives close() while a view holds it
    mem.close()  # twice is fine
    mem.unlink()
    assert not pool_path.exists()
    mem.unlink()


def test_default_path() -> None:
    path = default_path("stage-0")
    assert path.name == "strata-stage-0"
    if os.path.isdir("/dev/shm") and not os.environ.get("STRATA_POOL_DIR"):
        assert path.parent == Path(f"/dev/shm/strata-{os.geteuid()}")
        st = path.parent.stat()
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
    with pytest.raises(ValueError, match="pool file name"):
        default_path("../etc")
