"""stages/decode_layer.py: one C call per dense layer of a decode step gives the Python path's logits, hidden rows
and K/V rows bit for bit (rule 2), only where rule 1 holds, and a library that computes wrong is not used (rule 4).
"""
from __future__ import annotations

import pytest
import torch

from stages import byte_rows, decode_layer
from stages.batch import StepBatch
from stages.byte_rows import ByteLinear
from stages.checkpoint import load_checkpoint
from stages.kv_cache import KVCache
from stages.gguf_write import write_gguf
from stages.model import StageModel
from stages.quant_linear import RowStack
from stages.tiny import make_tiny_model
from tests.stages.harness import use_wrong_source

needs_layer = pytest.mark.skipif(not decode_layer.available(), reason=f"no decode layer here: "
                                 f"{decode_layer.unavailable_reason()}")
TABLE = 5  # chunks per slot
CELLS = 32


@pytest.fixture
def fresh_library(monkeypatch):
    decode_layer._library.cache_clear()
    yield monkeypatch
    decode_layer._library.cache_clear()


def _ckpt(tmp_path, arch: str):
    return load_checkpoint(make_tiny_model(tmp_path / arch, arch=arch, layers=3, hidden=128, heads=4, kv_heads=2,
                                           intermediate=256))


def _pool(model: StageModel, kv_dtype=torch.float32, slots: int = 4) -> KVCache:
    kv = KVCache(model.num_kv_layers, slots * TABLE, CELLS, model.kv_heads, model.head_dim, kv_dtype, "cpu",
                 n_slots=slots, table_chunks=TABLE)
    for s in range(slots):  # scattered: slot s holds chunks s, s + slots, s + 2 slots, ...
        kv.set_table(s, [s + slots * i for i in range(TABLE)])
    return kv


def _arrays(kv: KVCache) -> list[torch.Tensor]:
    return [*kv.k, *kv.v, *(kv.k_scale or ()), *(kv.v_scale or ())]


class Calls:
    """Counts the layers stages/decode_layer.py ran (`n`, one by one or in one call), its calls over all of a
    step's layers (`whole`, rule 5) and its final norm and head calls (`heads`, rule 6)."""

    def __init__(self, monkeypatch) -> None:
        self.n = self.whole = self.heads = 0
        run, run_all, logits = decode_layer.Step.run, decode_layer.Step.run_all, decode_layer.Step.logits

        def counted(step, *args):
            self.n += 1
            return run(step, *args)

        def counted_all(step, layers, *args):
            self.n += len(layers)
            self.whole += 1
            return run_all(step, layers, *args)

        def counted_head(step, *args):
            self.heads += 1
            return logits(step, *args)

        monkeypatch.setattr(decode_layer.Step, "run", counted)
        monkeypatch.setattr(decode_layer.Step, "run_all", counted_all)
        monkeypatch.setattr(decode_layer.Step, "logits", counted_head)


def _steps(lens: list[int], decodes: list[list[int]]) -> list[list[list[int]]]:
    """Prefill each slot, then decode steps over the given slots (a mixed step keeps the Python path)."""
    steps = [[[s, 0, n, 1] for s, n in enumerate(lens)]]
    pos = list(lens)
    for slots in decodes:
        step = []
        for s in slots:
            step.append([s, pos[s], 1, 1])
            pos[s] += 1
        steps.append(step)
    return steps


@needs_layer
@pytest.mark.parametrize("arch,kv_dtype", [("qwen3", torch.float32), ("qwen2", torch.float32),
                                           ("llama", torch.float32), ("qwen3", torch.int8), ("qwen2", torch.int8)])
def test_decode_steps_through_one_call_per_layer_are_the_python_steps_bit_for_bit(tmp_path, monkeypatch, arch,
                                                                                  kv_dtype):
    """Rule 2 on q/k norms (qwen3), biases (qwen2) and neither (llama), float32 and int8 K/V; 1 to 4 rows, a
    sliding window on one layer, contexts over several scattered chunks; the pools (values and int8 scales) after
    every step and the logits of every step."""
    _same_steps(_ckpt(tmp_path, arch), monkeypatch, kv_dtype)


@needs_layer
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("arch,qtype", [("qwen3", "Q8_0"), ("qwen2", "Q8_0"), ("llama", "Q4_0")])
def test_a_quantized_gguf_model_in_float32_runs_its_byte_rows_in_the_call(tmp_path, monkeypatch, arch, qtype, int8):
    """Rules 1-2 on byte rows: a Q8_0 (bytes) or Q4_0 (nibble pairs) file's projections (stages/byte_rows.py) are
    read in the call, bit for bit the Python path's, with float rows and with 8-bit ones (byte_rows rule 7)."""
    if not byte_rows.available():
        pytest.skip(f"no byte-rows kernel here: {byte_rows.unavailable_reason()}")
    src = make_tiny_model(tmp_path / arch, arch=arch, layers=3, hidden=128, heads=4, kv_heads=2, intermediate=256)
    ckpt = load_checkpoint(write_gguf(src, tmp_path / f"{arch}.gguf", qtype))
    model = StageModel(ckpt, 0, 3, dtype=torch.float32, int8_activations=int8)
    bits = 8 if qtype == "Q8_0" else 4
    names = ("qkv", "self_attn.o_proj", "gate_up", "mlp.down_proj")
    assert all(isinstance(model.layers[0][f"{n}.weight"], ByteLinear) and model.layers[0][f"{n}.weight"].bits == bits
               and model.layers[0][f"{n}.weight"].int8_activations == int8 for n in names)
    assert all(layer is not None for layer in model.decode_layers())
    _same_steps(ckpt, monkeypatch, torch.float32, int8)


@needs_layer
@pytest.mark.parametrize("int8", [False, True])
def test_a_q4_k_m_layer_runs_its_two_forms_of_qkv_in_the_call(tmp_path, monkeypatch, int8):
    """Rule 1's qkv of two forms: a Q4_K_M file's last layer keeps its v rows in Q6_K (bytes in groups of 16) after
    q and k in Q4_K (nibble pairs); every layer still runs in the call, bit for bit the Python path's."""
    if not byte_rows.available():
        pytest.skip(f"no byte-rows kernel here: {byte_rows.unavailable_reason()}")
    src = make_tiny_model(tmp_path / "m", arch="qwen3", layers=3, hidden=256, heads=4, kv_heads=2, intermediate=512)
    ckpt = load_checkpoint(write_gguf(src, tmp_path / "m.gguf", "Q4_K_M"))
    model = StageModel(ckpt, 0, 3, dtype=torch.float32, int8_activations=int8)
    qkv = model.layers[2]["qkv.weight"]
    assert isinstance(qkv, RowStack) and [(p.bits, p.group) for p in qkv.parts] == [(4, 32), (8, 16)]
    assert all(p.int8_activations == int8 for p in qkv.parts)
    layers = model.decode_layers()
    assert all(layer is not None for layer in layers) and layers[2].struct.qkv_rest.n == 2 * 64
    _same_steps(ckpt, monkeypatch, torch.float32, int8)


@needs_layer
def test_a_layer_of_byte_rows_takes_no_more_rows_than_their_kernel(tmp_path, monkeypatch):
    """Rule 1: with packed rows set to more rows than byte rows take, a step of byte-rows layers with more rows than
    byte_rows.MAX_ROWS keeps the Python path (the same values), one within it runs the call."""
    if not byte_rows.available():
        pytest.skip(f"no byte-rows kernel here: {byte_rows.unavailable_reason()}")
    src = make_tiny_model(tmp_path / "q", arch="qwen3", layers=3, hidden=128, heads=4, kv_heads=2, intermediate=256)
    model = StageModel(load_checkpoint(write_gguf(src, tmp_path / "q.gguf", "Q8_0")), 0, 3, dtype=torch.float32)
    monkeypatch.setattr(decode_layer.packed_rows, "MAX_ROWS", byte_rows.MAX_ROWS + 4)
    assert all(layer.max_rows == byte_rows.MAX_ROWS for layer in model.decode_layers())
    calls = Calls(monkeypatch)
    for rows, fused in ((byte_rows.MAX_ROWS + 2, 0), (byte_rows.MAX_ROWS, 3)):
        kv = _pool(model, slots=rows)
        batch = StepBatch.from_slots([[s, 3, 1, 1] for s in range(rows)])
        before = calls.n
        model.forward(batch, kv, torch.tensor([7] * rows))
        assert calls.n - before == fused, rows


def _same_steps(ckpt, monkeypatch, kv_dtype, int8: bool = False) -> None:
    on, off = (StageModel(ckpt, 0, 3, dtype=torch.float32, int8_activations=int8) for _ in range(2))
    for m in (on, off):
        m.sliding_windows = [None, 40, None]
    pools = [_pool(on, kv_dtype), _pool(off, kv_dtype)]
    calls = Calls(monkeypatch)
    g = torch.Generator().manual_seed(1)
    decodes = [[0], [0, 1], [2, 0, 1], [3, 2, 1, 0], [1], [2, 3]] * 3
    for slots in _steps([70, 33, 5, 100], decodes):
        ids = torch.randint(0, 200, (sum(n for _, _, n, _ in slots),), generator=g)
        before = calls.n
        got = on.forward(StepBatch.from_slots(slots), pools[0], ids)
        fused = calls.n - before
        monkeypatch.setenv("STRATA_DECODE_LAYER", "0")
        want = off.forward(StepBatch.from_slots(slots), pools[1], ids)
        monkeypatch.delenv("STRATA_DECODE_LAYER")
        assert fused == (3 if all(n == 1 for _, _, n, _ in slots) else 0)
        assert torch.equal(got, want)
        for a, b in zip(_arrays(pools[0]), _arrays(pools[1])):
            assert torch.equal(a, b)
    assert calls.n == 3 * len(decodes)
    assert calls.whole == calls.heads == len(decodes)  # rules 5 and 6: every decode step, layers and head in C


@needs_layer
def test_a_middle_stage_takes_hidden_rows_and_leaves_them_as_they_were(tmp_path, monkeypatch):
    ckpt = _ckpt(tmp_path, "qwen3")
    on, off = StageModel(ckpt, 1, 3, dtype=torch.float32), StageModel(ckpt, 1, 3, dtype=torch.float32)
    pools = [_pool(on), _pool(off)]
    calls = Calls(monkeypatch)
    g = torch.Generator().manual_seed(2)
    for slots in _steps([20, 9], [[0, 1], [1], [0, 1]]):
        x = torch.randn(sum(n for _, _, n, _ in slots), 128, generator=g)
        x0 = x.clone()
        got = on.forward(StepBatch.from_slots(slots), pools[0], x)
        assert torch.equal(x, x0)
        monkeypatch.setenv("STRATA_DECODE_LAYER", "0")
        want = off.forward(StepBatch.from_slots(slots), pools[1], x)
        monkeypatch.delenv("STRATA_DECODE_LAYER")
        assert torch.equal(got, want)
    assert calls.n == 2 * 3


@needs_layer
def test_outside_rule_1_the_python_path_runs(tmp_path, monkeypatch):
    ckpt = _ckpt(tmp_path, "qwen3")
    model = StageModel(ckpt, 0, 3, dtype=torch.float32)
    calls = Calls(monkeypatch)
    decode = [[0, 3, 1, 1]]

    def run(m: StageModel, kv: KVCache, slots: list) -> int:
        """One step of `slots` (a batch of its own, as each step has) over a new pool."""
        before = calls.n
        batch = StepBatch.from_slots(slots)
        m.forward(batch, kv, torch.tensor([7] * batch.num_tokens))
        return calls.n - before

    assert run(model, _pool(model), decode) == 3
    assert run(model, _pool(model, torch.int8), decode) == 3
    assert run(model, _pool(model), [[0, 0, 4, 1]]) == 0  # a prefill piece
    many = [[s, 3, 1, 1] for s in range(4)]
    monkeypatch.setattr(decode_layer.packed_rows, "MAX_ROWS", 3)
    assert run(model, _pool(model), many) == 0  # more rows than the packed-rows kernel takes
    monkeypatch.undo()
    calls = Calls(monkeypatch)
    monkeypatch.setenv("STRATA_DECODE_LAYER", "0")
    assert not decode_layer.available() and decode_layer.unavailable_reason() == "STRATA_DECODE_LAYER=0"
    assert run(model, _pool(model), decode) == 0
    monkeypatch.delenv("STRATA_DECODE_LAYER")
    plain = StageModel(ckpt, 0, 3, dtype=torch.float32, pack_weights=False)  # no packed panels
    assert run(plain, _pool(plain), decode) == 0
    assert plain._decode_layers == [None, None, None]


@pytest.mark.parametrize("edit", [("out[i] += mixed[i]", "out[i] -= mixed[i]"),
                                  ("put_row(row + q_width + kv_width, v_pool", "put_row(row + q_width, v_pool"),
                                  ("L->q_norm, L->k_norm, S->eps", "NULL, NULL, S->eps"),
                                  ("nearbyintf(x[i] / by)", "truncf(x[i] / by)"),
                                  ("w->bits, w->scale, w->offset", "w->bits, w->offset, w->scale"),
                                  ("stage + rows * a->n + t * b->n", "stage + t * b->n")])
def test_a_library_that_computes_wrong_is_not_used(fresh_library, tmp_path, edit):
    """Rule 4: the first-use check against float64 torch; a source wrong in any one place fails it."""
    use_wrong_source(decode_layer, edit, tmp_path, fresh_library)
    if not all(p.available() for p in (decode_layer.cpu_ops, decode_layer.packed_rows, decode_layer.cpu_attention)):
        pytest.skip("the parts the decode layer runs are not available here")
    assert not decode_layer.available()
    assert "disagrees with torch" in decode_layer.unavailable_reason()


@needs_layer
def test_rows_of_another_width_are_refused_before_any_is_read(tmp_path):
    """A middle stage's hidden rows come from the wire: a width other than the model's is a ValueError, not a read
    past their end, and the pool is left as it was."""
    ckpt = _ckpt(tmp_path, "qwen3")
    model = StageModel(ckpt, 1, 3, dtype=torch.float32)
    kv = _pool(model)
    before = [a.clone() for a in _arrays(kv)]
    for x in (torch.randn(1, 64), torch.randn(1, 256)):
        with pytest.raises(ValueError):
            model.forward(StepBatch.from_slots([[0, 3, 1, 1]]), kv, x)
    assert all(torch.equal(a, b) for a, b in zip(_arrays(kv), before))
