"""pool/state_file.py and stages/state_pool.py rule 5: a CPU stage's state entries live in a private file beside its
pool file and come back, bytes and token counts, when a restarted stage re-attaches it; an entry a step or a copy
was changing when the stage died is unknown; a file of another layout is replaced, one that is not private is
refused."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pool.layer_kinds import LinearGeometry
from pool.runtime import RuntimeDirError, private_dir
from pool.state_file import StateFile, StateLayout
from stages.batch import StepBatch
from stages.state_pool import UNKNOWN, StatePool

GEOMETRY = LinearGeometry(key_heads=2, value_heads=4, key_dim=8, value_dim=8, kernel=4)


def pool(path: Path, n_entries: int = 3, dtype: torch.dtype = torch.bfloat16) -> StatePool:
    return StatePool(n_entries, 2, GEOMETRY, dtype, "cpu", path)


@pytest.fixture
def where(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    private_dir(d)
    return d / "strata-x-stage0.state"


def test_entries_and_their_counts_come_back_from_the_file(where: Path) -> None:
    p = pool(where)
    assert not p.reattached and p.held() == [0, 0, 0] and where.stat().st_mode & 0o777 == 0o600
    g = torch.Generator().manual_seed(0)
    p.conv.copy_(torch.randn(p.conv.shape, generator=g))
    p.recurrent.copy_(torch.randn(p.recurrent.shape, generator=g))
    batch = StepBatch.from_slots([[0, 0, 7, 1], [1, 0, 3, 1]], state_entries=[2, 0])
    p.begin(batch)
    p.commit(batch)
    p.copy(2, 1)
    p.session = "s1"
    conv, recurrent = p.conv.clone(), p.recurrent.clone()
    p.close()  # a crash: the file stays
    again = pool(where)
    assert again.reattached and again.session == "s1" and again.held() == [3, 7, 7]
    assert torch.equal(again.conv, conv) and torch.equal(again.recurrent, recurrent)
    assert torch.equal(again.conv[1], again.conv[2])
    again.close()


def test_a_step_that_did_not_finish_leaves_its_entries_unknown(where: Path) -> None:
    p = pool(where)
    p.begin(StepBatch.from_slots([[0, 0, 5, 1]], state_entries=[1]))  # the stage dies in the forward
    p.close()
    again = pool(where)
    assert again.held() == [0, UNKNOWN, 0]
    again.forget()
    assert pool_held(where) == [UNKNOWN] * 3
    again.close()


def pool_held(where: Path) -> list[int]:
    p = pool(where)
    try:
        return p.held()
    finally:
        p.close()


def test_another_layout_gets_a_fresh_file_and_a_foreign_one_is_refused(where: Path) -> None:
    p = pool(where)
    p.tokens[0] = 9
    p.close()
    assert pool_held(where) == [9, 0, 0]
    other = pool(where, n_entries=4)  # more entries: another layout, a fresh file
    assert not other.reattached and other.held() == [0] * 4
    other.close()
    f32 = pool(where, n_entries=4, dtype=torch.float32)  # the conv dtype is part of the layout too
    assert not f32.reattached
    f32.close()
    layout = StateLayout(4, 2, 3, GEOMETRY.conv_dim, 4, 8, 8, "float32")
    with pytest.raises(Exception, match="n_entries is 4 in the file, expected 5"):
        StateFile.attach(where, StateLayout(5, 2, 3, GEOMETRY.conv_dim, 4, 8, 8, "float32"))
    StateFile.attach(where, layout).close()
    where.unlink()
    target = where.with_name("elsewhere")
    target.write_bytes(b"\0" * 64)
    os.symlink(target, where)
    with pytest.raises(RuntimeDirError, match="symlink"):
        pool(where)
    assert target.read_bytes() == b"\0" * 64


def test_a_cuda_stage_keeps_its_entries_on_the_device_and_no_file(tmp_path: Path) -> None:
    """Rule 4 of pool/state_file.py, checked on the code path: a pool for a non-CPU device makes no file."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    p = StatePool(2, 2, GEOMETRY, torch.bfloat16, "cuda", tmp_path / "s.state")
    assert p.file is None and not (tmp_path / "s.state").exists() and p.conv.is_cuda
