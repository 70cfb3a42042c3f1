"""stages/cpu_ops.py: the C layer ops give the torch code's values (rules 1-3), inside the model too, and a library
that is missing, turned off or wrong leaves the torch code running (rule 4)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stages import cpu_ops
from stages.batch import StepBatch
from stages.checkpoint import load_checkpoint
from stages.kv_cache import KVCache
from stages.model import StageModel, qk_norm, rms_norm
from stages.rope import apply_rope
from stages.tiny import make_tiny_model
from tests.stages.harness import use_wrong_source

needs_ops = pytest.mark.skipif(not cpu_ops.available(), reason=f"no CPU layer ops here: "
                               f"{cpu_ops.unavailable_reason()}")
# Rows of one decode step and of a prefill piece (past PARALLEL_FLOATS: shared by the threads).
ROWS = (1, 3, 700)


@pytest.fixture
def fresh_library(monkeypatch):
    """`_library` rebuilt under the test's environment, and rebuilt again afterwards for the other tests."""
    cpu_ops._library.cache_clear()
    yield monkeypatch
    cpu_ops._library.cache_clear()


@needs_ops
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [64, 100, 768])
def test_rms_norm_with_and_without_the_residual_add_is_the_torch_norm(rows, width):
    g = torch.Generator().manual_seed(rows * width)
    x, d = torch.randn(rows, width, generator=g) * 3, torch.randn(rows, width, generator=g)
    w = torch.randn(width, generator=g)
    s, out = cpu_ops.rms_norm(x, w, 1e-6)
    assert s is x
    torch.testing.assert_close(out, rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6)
    x0 = x.clone()
    s, out = cpu_ops.rms_norm(x, w, 1e-5, residual=d)
    assert torch.equal(x, x0)  # the inputs are left as they were
    assert torch.equal(s, x + d)
    torch.testing.assert_close(out, rms_norm(x + d, w, 1e-5), rtol=1e-6, atol=1e-6)
    _, out = cpu_ops.rms_norm(x, None, 1e-6)
    torch.testing.assert_close(out, F.rms_norm(x, (width,), None, 1e-6), rtol=1e-6, atol=1e-6)


@needs_ops
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,normed", [(12, 4, 64, True), (8, 8, 128, False), (6, 2, 16, True),
                                                            (4, 1, 96, False)])
def test_qk_norm_and_rope_in_place_are_the_torch_ops(rows, heads, kv_heads, head_dim, normed):
    g = torch.Generator().manual_seed(rows + heads + head_dim)
    width = (heads + 2 * kv_heads) * head_dim + 5  # q, k, v and more (a gate) in each row
    qkv = torch.randn(rows, width, generator=g)
    qn = torch.randn(head_dim, generator=g) if normed else None
    kn = torch.randn(head_dim, generator=g) if normed else None
    angles = torch.rand(rows, 1) * 4000 * torch.rand(1, head_dim, generator=g)
    cos, sin = angles.cos(), angles.sin()
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    want = apply_rope(qk_norm(qk, qn, kn, heads, 1e-6) if normed else qk, cos, sin)
    rest = qkv[:, (heads + kv_heads) * head_dim:].clone()
    assert cpu_ops.qk_norm_rope_(qkv, heads, kv_heads, head_dim, qn, kn, 1e-6, cos, sin)
    torch.testing.assert_close(qk, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], rest)  # v and the rest untouched


@needs_ops
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_is_the_torch_product_over_the_whole_range(rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 3072, generator=g) * 20  # past exp's clamp at both ends
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -1e-30])
    got = cpu_ops.silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate_up[:, :3072]) * gate_up[:, 3072:], rtol=1e-5, atol=1e-6)


@needs_ops
def test_outside_rule_1_nothing_is_done_and_the_torch_code_runs():
    x, w = torch.randn(2, 64), torch.randn(64)
    assert cpu_ops.rms_norm(x.bfloat16(), w, 1e-6) is None
    assert cpu_ops.rms_norm(x.t().contiguous().t(), w, 1e-6) is None  # columns, not rows
    assert cpu_ops.rms_norm(x, torch.randn(32), 1e-6) is None
    qkv = torch.randn(2, 3 * 64)
    before = qkv.clone()
    half = torch.randn(2, 32)  # a partial rotary: narrower than a head
    assert not cpu_ops.qk_norm_rope_(qkv, 1, 1, 64, None, None, 1e-6, half, half)
    assert not cpu_ops.qk_norm_rope_(qkv, 1, 1, 64, torch.randn(64), None, 1e-6, torch.randn(2, 64),
                                     torch.randn(2, 64))
    assert torch.equal(qkv, before)
    assert cpu_ops.silu_mul(torch.randn(2, 64).bfloat16()) is None


def _two_models(tmp_path, arch: str) -> tuple[StageModel, StageModel]:
    ckpt = load_checkpoint(make_tiny_model(tmp_path / arch, arch=arch, layers=2, hidden=128, heads=4, kv_heads=2,
                                           intermediate=256))
    on, off = StageModel(ckpt, 0, 2, dtype=torch.float32), StageModel(ckpt, 0, 2, dtype=torch.float32)
    off.cpu_ops = False
    return on, off


@needs_ops
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_model_step_with_the_ops_equals_the_torch_step(tmp_path, arch):
    """Prefill pieces (many rows: the threaded path) and decode steps of 3 slots, through the same pools."""
    on, off = _two_models(tmp_path, arch)
    assert on.cpu_ops and not off.cpu_ops
    pools = [KVCache(on.num_kv_layers, 16, 32, on.kv_heads, on.head_dim, torch.float32, "cpu", n_slots=3,
                     table_chunks=5) for _ in range(2)]
    for kv in pools:
        for s in range(3):
            kv.set_table(s, [s * 5 + i for i in range(5)])
    g = torch.Generator().manual_seed(0)
    steps = [[[0, 0, 150, 1], [1, 0, 40, 1], [2, 0, 97, 1]], [[0, 150, 1, 1], [1, 40, 1, 1], [2, 97, 1, 1]],
             [[0, 151, 1, 1], [1, 41, 3, 1], [2, 98, 1, 1]]]
    for slots in steps:
        batch = StepBatch.from_slots(slots)
        ids = torch.randint(0, 200, (batch.num_tokens,), generator=g)
        got = on.forward(batch, pools[0], ids)
        want = off.forward(StepBatch.from_slots(slots), pools[1], ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pools[0].k[0], pools[1].k[0], rtol=1e-5, atol=1e-5)


def test_without_a_compiler_or_when_turned_off_the_torch_code_runs(fresh_library, tmp_path):
    fresh_library.setenv("STRATA_KERNEL_CACHE", str(tmp_path / "kernels"))
    fresh_library.setenv("CC", str(tmp_path / "no-such-cc"))
    assert not cpu_ops.available() and "no C compiler" in cpu_ops.unavailable_reason()
    assert cpu_ops.rms_norm(torch.randn(2, 64), torch.randn(64), 1e-6) is None
    assert cpu_ops.silu_mul(torch.randn(2, 64)) is None
    cpu_ops._library.cache_clear()
    fresh_library.delenv("CC")
    fresh_library.setenv("STRATA_CPU_KERNELS", "0")
    assert not cpu_ops.available() and cpu_ops.unavailable_reason() == "STRATA_CPU_KERNELS=0"


@pytest.mark.parametrize("edit", [("sum / (float)n + eps", "sum / (float)(n + 1) + eps"),
                                  ("x[i] = y[i] * c[i] + (-y[i + half]) * s[i];", "x[i] = y[i] * c[i];"),
                                  ("(g[i] / (1.0f + exp_f(-g[i]))) * u[i]", "(g[i] / (1.0f + exp_f(g[i]))) * u[i]")])
def test_a_library_that_computes_wrong_is_not_used(fresh_library, tmp_path, edit):
    """Rule 4: the first-use check against the torch code; a source with any one function off fails it."""
    use_wrong_source(cpu_ops, edit, tmp_path, fresh_library)
    assert not cpu_ops.available()
    assert "disagrees with torch" in cpu_ops.unavailable_reason()
