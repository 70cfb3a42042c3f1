"""A dense decoder layer of a CPU stage over a decode step, in one C call (csrc/cpu_decode_layer.c).

With its products read at the memory's pace (stages/packed_rows.py), a decode step of few rows still spent a
sixth of its time between them: each layer's ten or so calls (two norms, the q/k norm and rotary, the K/V write,
the attention plan, the SiLU product, the residual add), each a Python call, a dispatch and an allocation, run
with caches the streamed weights have just emptied (the 104M qwen3, 1 row at 512 cells: ~2 ms of a ~15 ms step
outside the products and the attention kernel; docs/BENCHMARKS.md "One call per decode layer"). Here a layer
is one call of a C function that runs the same C functions in the same order.

Rules:
1. Only for a step whose rows are all decode rows (one decode group over the step's rows, in order), at most
   packed_rows.MAX_ROWS of them (byte_rows.MAX_ROWS for a layer with byte rows: `Layer.max_rows`), on a CPU stage
   in float32 reading the pool itself (`KVCache` with float32 or int8 K/V, not the device window's view), and
   only for a dense attention layer (no linear attention, no routed experts, no output gate) whose four products
   are each read from packed panels (stages/packed_rows.py) or from float32 byte rows (stages/byte_rows.py: a
   quantized GGUF model in float32), the fused qkv's rows in one such form or in two (a RowStack of two parts: a
   Q4_K_M layer's Q6_K v rows after its Q4_K q and k), and whose norms are float32. Every other step and layer
   runs the Python path of stages/model.py, unchanged; a step may mix both.
2. The call runs what the Python path runs: the layer ops of stages/cpu_ops.py, the packed-rows or byte-rows
   products (of 8-bit rows where the weight says so: stages/byte_rows.py rule 7) and the decode attention kernel
   of stages/cpu_attention.py (their sources compiled into this library), in the same order, with the same
   arguments and the same attention plan, and the K/V rows copied into their cells (into an int8 pool quantized
   as attention.quantize_int8 does, the same values and scales).
   The layer's output, the K/V rows in the pool and the step's logits are the same bit for bit (tested against
   the Python path, which the tests hold to transformers). So it is used only where all three are available.
3. What stays the same for a layer (its weights' panels, biases, norms) is gathered once (`Layer`); what stays
   the same over a step's layers (rows, cells, rotary rows, the attention plan, one scratch buffer) once per step
   and sliding window (`Step`). The pool's arrays are passed to each call, so a pool mapped anew is read where
   it is now. The layer's output goes to one buffer of the step (`Step.out`), the first layer's input is left
   as it was.
4. The library is built, cached, trusted and checked by the rules of stages/cpu_build.py: at first use one
   seeded layer (biases, q/k norms, byte rows, two entries over scattered chunks) against a float64 torch
   reference, and its int8 K/V rows and scales against quantize_int8 of the float32 ones.
   `STRATA_DECODE_LAYER=0` (or `STRATA_CPU_KERNELS=0`) turns it off.
5. When every layer of the stage takes the call (rule 1) and the step's rows fit every one's kernels, the layers
   run in one call (`Step.run_all`, `strata_decode_layers`: the same calls in layer order, each layer's output the
   next one's input, so the values are those of one call per layer, bit for bit). Between two layers a decode
   step streams a layer's weights (megabytes) past the caches, and the Python, ctypes and torch code of the next
   call then runs from memory: an op that takes 16-36 us warm took 215-260 us after 80 MB streamed (docs/
   BENCHMARKS.md, "A step's layers in one call"). One call touches that code once a step instead of once a layer.
6. On the last stage, a decode step whose rows all sample runs the final norm and the head in one call too
   (`Step.logits`, `strata_decode_head`: the layer ops' RMSNorm, then the head's product by its packed panels or
   byte rows, as `linear` multiplies it for that many rows; the same logits bit for bit), when the head is in one
   of rule 1's forms and the rows fit its kernel (`Head.max_rows`).
"""
from __future__ import annotations

import ctypes
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

from stages import byte_rows, cpu_attention, cpu_build, cpu_ops, packed_rows
from stages.attention import quantize_int8, token_cells
from stages.batch import StepBatch
from stages.byte_rows import ByteLinear
from stages.cpu_build import KernelRefused
from stages.kv_cache import KVCache
from stages.packed_linear import PackedLinear
from stages.quant_linear import Planes, RowStack

log = logging.getLogger("strata.stage")

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_decode_layer.c"

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Weight(ctypes.Structure):
    _fields_ = [("panels", _P), ("bias", _P), ("n", _L), ("k", _L), ("kp", _L), ("bytes", _P), ("scale", _P),
                ("offset", _P), ("zero", _F), ("group", _L), ("bits", _I), ("int8", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("qkv", _Weight), ("o", _Weight),
                ("gate_up", _Weight), ("down", _Weight), ("qkv_rest", _Weight)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _L), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("threads", _I),
                ("eps", _F), ("scale", _F), ("cos", _P), ("sin", _P), ("cells", _P), ("tables", _P),
                ("table_stride", _L), ("slots", _P), ("lens", _P), ("lo", _P), ("part_first", _P),
                ("chunk_cells", _I), ("part_cells", _I), ("work", _P), ("scratch", _P), ("scratch_floats", _L)]


_SIGNATURES = {"strata_decode_layer": [ctypes.POINTER(_Layer), ctypes.POINTER(_Step), _P, _P, _P, _P, _P, _P],
               "strata_decode_layers": [_P, _P, _P, _I, _P, _P],
               "strata_decode_head": [_P, ctypes.POINTER(_Weight), _P, _L, _I, _F, _P, _P, _I],
               "strata_decode_layer_scratch": [_L, _L, _L, _L, _L]}
_WEIGHTS = (("qkv", "qkv"), ("o", "self_attn.o_proj"), ("gate_up", "gate_up"), ("down", "mlp.down_proj"))


def enabled() -> bool:
    return os.environ.get("STRATA_DECODE_LAYER", "1") != "0"


def build() -> Path:
    return cpu_build.build(SOURCE, "cpu_decode_layer")


@lru_cache(maxsize=1)
def _library() -> tuple[dict[str, object] | None, str | None]:
    """({name: function}, None), or (None, why not): built, loaded and checked once per process (rule 4)."""
    for name, part in (("layer ops", cpu_ops), ("packed-rows kernel", packed_rows),
                       ("decode attention kernel", cpu_attention)):
        if not part.available():
            return None, f"no {name}: {part.unavailable_reason()}"  # rule 2
    fns, why = cpu_build.load(build, _SIGNATURES, _self_check, "Decode layer")
    if fns:
        fns["strata_decode_layer_scratch"].restype = _L
    return fns, why


def available() -> bool:
    return enabled() and _library()[0] is not None


def unavailable_reason() -> str | None:
    return "STRATA_DECODE_LAYER=0" if not enabled() else _library()[1]


def log_layers(layers: list["Layer | None"]) -> None:
    """Says in the stage's log how many of its layers a decode step runs as one call each, or why none."""
    if not available():
        log.info("decode steps: every layer in Python (stages/decode_layer.py: %s)", unavailable_reason())
    else:
        log.info("decode steps: %d of %d layers one C call each (stages/decode_layer.py)",
                 sum(x is not None for x in layers), len(layers))


def _f32(t: object, shape: tuple[int, ...]) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
            and tuple(t.shape) == shape and t.is_contiguous())


def _weight(weight: object) -> tuple[_Weight, list[torch.Tensor]] | None:
    """A weight's struct and the tensors it points into, for the forms rule 1 names; None for any other."""
    if isinstance(weight, PackedLinear) and weight.panels is not None:
        p = weight.panels
        return _Weight(p.address, None, p.n, p.k, p.kp), [p.packed]
    if isinstance(weight, ByteLinear) and weight.dtype == torch.float32:
        (n, k), arrays = weight.shape, [weight.q, weight.scale]
        offset = None if weight.offset is None else weight.offset.data_ptr()  # None: -zero * scale
        return _Weight(None, None, n, k, k, *(a.data_ptr() for a in arrays), offset, weight.zero, weight.group,
                       weight.bits, int(weight.int8_activations)), arrays + [weight.offset] * (offset is not None)
    return None


class Layer:
    """Rule 3: one layer's fixed arguments, or `Layer.of` gives None where rule 1 keeps the Python path."""

    def __init__(self, struct: _Layer, keep: list[torch.Tensor], max_rows: int) -> None:
        self.struct, self.keep = struct, keep  # keep: the tensors the struct points into
        self.max_rows = max_rows  # the most rows its products' kernels take (rule 1)

    @classmethod
    def of(cls, w: dict, hidden: int, head_dim: int) -> "Layer | None":
        if "experts.gate_up" in w:
            return None
        weights, keep, max_rows = {}, [], packed_rows.MAX_ROWS
        for field, name in _WEIGHTS:
            weight, bias = w.get(name + ".weight"), w.get(name + ".bias")
            # a fused qkv whose rows are held in two forms (a Q4_K_M layer's Q6_K v): two products in the call
            parts = weight.parts if isinstance(weight, RowStack) and field == "qkv" else [weight]
            forms = [_weight(p) for p in parts]
            if len(forms) > 2 or None in forms:
                return None
            n = sum(struct.n for struct, _ in forms)
            if bias is not None and not _f32(bias, (n,)):
                return None
            at = 0
            for i, (struct, arrays) in enumerate(forms):
                struct.bias = None if bias is None else bias[at:].data_ptr()
                weights[field if i == 0 else field + "_rest"] = struct
                keep += arrays
                at += struct.n
                if struct.bytes:
                    max_rows = min(max_rows, byte_rows.MAX_ROWS)
            keep += [bias] if bias is not None else []
        norms = [w.get(n) for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                    "self_attn.q_norm.weight", "self_attn.k_norm.weight")]
        if not (_f32(norms[0], (hidden,)) and _f32(norms[1], (hidden,))):
            return None
        if (norms[2] is None) != (norms[3] is None) or not all(n is None or _f32(n, (head_dim,)) for n in norms[2:]):
            return None
        keep += [n for n in norms if n is not None]
        ptrs = [None if n is None else n.data_ptr() for n in norms]
        return cls(_Layer(*ptrs, **weights), keep, max_rows)


class Head:
    """Rule 6: the last stage's final norm and head weight, or `Head.of` gives None where the Python path runs."""

    def __init__(self, norm: torch.Tensor, struct: _Weight, keep: list[torch.Tensor], max_rows: int) -> None:
        self.norm, self.struct, self.keep, self.max_rows = norm, struct, keep, max_rows

    @classmethod
    def of(cls, norm: object, head: object, hidden: int) -> "Head | None":
        form = _weight(head)
        if form is None or not _f32(norm, (hidden,)) or form[0].k != hidden:
            return None
        struct, keep = form
        return cls(norm, struct, keep, byte_rows.MAX_ROWS if struct.bytes else packed_rows.MAX_ROWS)


class Step:
    """Rule 3: a step's fixed arguments per sliding window; `Step.of` gives None where rule 1 keeps the Python
    path for the whole step."""

    def __init__(self, batch: StepBatch, kv: KVCache, cos: torch.Tensor, sin: torch.Tensor, hidden: int,
                 heads: int, eps: float, scale: float, fns: dict[str, object] | None = None) -> None:
        self.fns = fns or _library()[0]  # the library's functions (given by the first-use check)
        self.batch, self.kv, self.hidden, self.heads, self.eps, self.scale = batch, kv, hidden, heads, eps, scale
        self.rows = batch.num_tokens
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        self.cells = token_cells(kv, batch)
        self.threads = torch.get_num_threads()
        self.out = torch.empty(self.rows, hidden, dtype=torch.float32)
        self._structs: dict[tuple[int | None, int, int], tuple[_Step, tuple]] = {}

    @classmethod
    def of(cls, batch: StepBatch, kv: object, cos: torch.Tensor, sin: torch.Tensor, hidden: int, heads: int,
           eps: float, scale: float) -> "Step | None":
        if not (isinstance(kv, KVCache) and len(batch.groups) == 1
                and cpu_attention.takes(kv, torch.float32, heads)):  # float32 queries: float32 or int8 K/V
            return None
        g, n = batch.groups[0], batch.num_tokens
        if not (g.kind == "decode" and g.rows == range(0, n) and 0 < n <= packed_rows.MAX_ROWS
                and cos.dtype == torch.float32 and cos.shape == (n, kv.head_dim) and available()):
            return None
        return cls(batch, kv, cos, sin, hidden, heads, eps, scale)

    def _struct(self, layer: Layer, window: int | None) -> _Step:
        kv, s = self.kv, layer.struct
        key = (window, s.qkv.n + s.qkv_rest.n, s.gate_up.n)
        if key not in self._structs:
            plan = cpu_attention.plan(self.batch, kv, 0, window)  # paged_decode's own (rule 2)
            work, (tables, stride, slots, lens, lo, *_), (part, part_first, _) = plan.fixed(kv, self.heads,
                                                                                           kv.head_dim)
            floats = self.fns["strata_decode_layer_scratch"](self.rows, self.hidden, key[1], self.heads * kv.head_dim,
                                                             s.gate_up.n)
            scratch = torch.empty(floats, dtype=torch.float32)
            struct = _Step(self.rows, self.hidden, self.heads, kv.kv_heads, kv.head_dim, self.threads, self.eps,
                           self.scale, self.cos.data_ptr(), self.sin.data_ptr(), self.cells.data_ptr(), tables,
                           stride, slots, lens, lo, part_first, kv.chunk_cells, part, work.data_ptr(),
                           scratch.data_ptr(), floats)
            self._structs[key] = (struct, (plan, work, scratch))
        return self._structs[key][0]

    def run(self, layer: Layer, kv_layer: int, window: int | None, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for input `x [rows, hidden]` float32, in `self.out` (rule 3)."""
        x = self._input(x)
        rc = self.fns["strata_decode_layer"](ctypes.byref(layer.struct), ctypes.byref(self._struct(layer, window)),
                                             *self._pools(kv_layer), x.data_ptr(), self.out.data_ptr())
        if rc != 0:
            raise ValueError(f"strata_decode_layer refused a step of {self.rows} rows ({rc})")
        return self.out

    def run_all(self, layers: list[Layer], kv_layers: list[int], windows: list[int | None],
                x: torch.Tensor) -> torch.Tensor:
        """Rule 5: `layers` one after another in one call (layer i on K/V layer kv_layers[i] with window
        windows[i]), the first on `x`; the last one's output in `self.out`."""
        x = self._input(x)
        n = len(layers)
        structs = (_P * n)(*[ctypes.addressof(layer.struct) for layer in layers])
        steps = (_P * n)(*[ctypes.addressof(self._struct(layer, w)) for layer, w in zip(layers, windows)])
        pools = (_P * (4 * n))(*[p for kv_layer in kv_layers for p in self._pools(kv_layer)])
        rc = self.fns["strata_decode_layers"](structs, steps, pools, n, x.data_ptr(), self.out.data_ptr())
        if rc != 0:
            raise ValueError(f"strata_decode_layers refused a step of {self.rows} rows over {n} layers ({rc})")
        return self.out

    def logits(self, head: Head, x: torch.Tensor) -> torch.Tensor:
        """Rule 6: float32 logits [rows, vocab] of the step's rows `x` (the last layer's output)."""
        x = self._input(x)
        out = torch.empty(self.rows, head.struct.n, dtype=torch.float32)
        scratch = torch.empty(self.rows, self.hidden, dtype=torch.float32)
        rc = self.fns["strata_decode_head"](head.norm.data_ptr(), ctypes.byref(head.struct), x.data_ptr(), self.rows,
                                            self.hidden, self.eps, scratch.data_ptr(), out.data_ptr(), self.threads)
        if rc != 0:
            raise ValueError(f"strata_decode_head refused a step of {self.rows} rows ({rc})")
        return out

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape != (self.rows, self.hidden) or x.dtype != torch.float32:
            raise ValueError(f"a decode layer takes float32 rows [{self.rows}, {self.hidden}], got {x.dtype} "
                             f"{list(x.shape)}")  # the C code reads exactly that many values
        return x if x.is_contiguous() else x.contiguous()

    def _pools(self, kv_layer: int) -> tuple[int, int, int | None, int | None]:
        """K/V layer `kv_layer`'s arrays where they are now (rule 3): k, v, and for an int8 pool its scales."""
        kv = self.kv
        scales = (kv.k_scale[kv_layer].data_ptr(), kv.v_scale[kv_layer].data_ptr()) if kv.quantized else (None, None)
        return kv.k[kv_layer].data_ptr(), kv.v[kv_layer].data_ptr(), *scales


def _self_check(fns: dict[str, object]) -> None:
    """Rule 4: one seeded layer (its down projection byte rows), two decode entries over scattered chunks, against
    float64 torch."""
    fns["strata_decode_layer_scratch"].restype = _L
    g = torch.Generator().manual_seed(0)
    hidden, heads, kv_heads, hd, inter, cells, eps = 64, 4, 2, 16, 128, 8, 1e-6
    qkv_n = (heads + 2 * kv_heads) * hd

    def rand(*shape: int, s: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * s

    plain = {"qkv": rand(qkv_n, hidden), "self_attn.o_proj": rand(hidden, heads * hd),
             "gate_up": rand(2 * inter, hidden)}
    w = {f"{k}.weight": PackedLinear(v) for k, v in plain.items()}
    q = torch.randint(0, 256, (hidden, inter), generator=g, dtype=torch.uint8)  # down as byte rows (rule 1)
    scale, offset = rand(hidden, inter // 32, s=0.003), rand(hidden, inter // 32, s=0.05)
    w["mlp.down_proj.weight"] = ByteLinear(Planes([q & 15, q >> 4], [scale, 16 * scale], offset), torch.float32)
    plain["mlp.down_proj"] = (q.view(hidden, -1, 32) * scale.unsqueeze(-1) + offset.unsqueeze(-1)).view(hidden, inter)
    w.update({"qkv.bias": rand(qkv_n), "mlp.down_proj.bias": rand(hidden), "input_layernorm.weight": 1 + rand(hidden),
              "post_attention_layernorm.weight": 1 + rand(hidden), "self_attn.q_norm.weight": 1 + rand(hd),
              "self_attn.k_norm.weight": 1 + rand(hd)})
    layer = Layer.of(w, hidden, hd)
    if layer is None:
        raise KernelRefused("the check's layer is not read from packed panels and byte rows here")
    kv = KVCache(1, 4, cells, kv_heads, hd, torch.float32, "cpu", n_slots=2, table_chunks=2)
    kv.set_table(0, [3, 1])
    kv.set_table(1, [0, 2])
    kv.k[0].copy_(rand(*kv.k[0].shape, s=1.0))
    kv.v[0].copy_(rand(*kv.v[0].shape, s=1.0))
    pool_k, pool_v = kv.k[0].reshape(-1, kv_heads, hd).double(), kv.v[0].reshape(-1, kv_heads, hd).double()
    old = [kv.k[0].reshape(-1, kv_heads, hd).clone(), kv.v[0].reshape(-1, kv_heads, hd).clone()]
    lens = [11, 5]
    batch = StepBatch.from_slots([[0, lens[0] - 1, 1, 1], [1, lens[1] - 1, 1, 1]])
    angles = torch.rand(2, hd // 2, generator=g) * 10
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    x = rand(2, hidden, s=1.0)
    step = Step(batch, kv, cos, sin, hidden, heads, eps, hd**-0.5, fns)
    got = step.run(layer, 0, None, x).clone()

    def norm(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight.double()

    def rope(t: torch.Tensor) -> torch.Tensor:
        half = hd // 2
        return t * cos.double()[:, None] + torch.cat((-t[..., half:], t[..., :half]), -1) * sin.double()[:, None]

    xd, d = x.double(), {k: v.double() for k, v in plain.items()}
    qkv = norm(xd, w["input_layernorm.weight"]) @ d["qkv"].T + w["qkv.bias"].double()
    q = rope(norm(qkv[:, :heads * hd].view(2, heads, hd), w["self_attn.q_norm.weight"]))
    k = rope(norm(qkv[:, heads * hd:(heads + kv_heads) * hd].view(2, kv_heads, hd), w["self_attn.k_norm.weight"]))
    v = qkv[:, (heads + kv_heads) * hd:].view(2, kv_heads, hd)
    tables, attn = [[3, 1], [0, 2]], []
    for e, n in enumerate(lens):
        at = [tables[e][p // cells] * cells + p % cells for p in range(n)]
        ke, ve = pool_k[at].clone(), pool_v[at].clone()
        ke[-1], ve[-1] = k[e], v[e]
        ke, ve = ke.repeat_interleave(heads // kv_heads, 1), ve.repeat_interleave(heads // kv_heads, 1)
        weights = torch.softmax(torch.einsum("hd,chd->hc", q[e], ke) * hd**-0.5, -1)
        attn.append(torch.einsum("hc,chd->hd", weights, ve).reshape(-1))
    s = xd + torch.stack(attn) @ d["self_attn.o_proj"].T
    gate_up = norm(s, w["post_attention_layernorm.weight"]) @ d["gate_up"].T
    mlp = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    want = s + mlp @ d["mlp.down_proj"].T + w["mlp.down_proj.bias"].double()
    written = kv.k[0].reshape(-1, kv_heads, hd)[[1 * cells + 2, 0 * cells + 4]].double()
    if not (torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4) and torch.allclose(written, k, atol=1e-5)):
        raise KernelRefused(f"strata_decode_layer disagrees with torch by "
                            f"{(got.double() - want).abs().max().item():.2e}")
    # The same layer with its qkv rows in two parts (rule 1: the v rows apart), the same values to float rounding.
    v_at = (heads + kv_heads) * hd
    split = Layer.of({**w, "qkv.weight": RowStack([PackedLinear(plain["qkv"][:v_at].contiguous()),
                                                   PackedLinear(plain["qkv"][v_at:].contiguous())])}, hidden, hd)
    if split is None or split.struct.qkv_rest.n != kv_heads * hd:
        raise KernelRefused("the check's layer of two qkv parts is not read in the call here")
    parts = step.run(split, 0, None, x)
    if not torch.allclose(parts.double(), want, rtol=1e-4, atol=1e-4):
        raise KernelRefused(f"strata_decode_layer with qkv in two parts disagrees with torch by "
                            f"{(parts.double() - want).abs().max().item():.2e}")
    # The same step on an int8 pool holding the old rows quantized: its new rows and scales are quantize_int8 of
    # the float32 rows just written, and its output is the float one's to int8's precision (within 5% of the largest
    # value: wrong scales or rows miss by far more).
    q8 = KVCache(1, 4, cells, kv_heads, hd, torch.int8, "cpu", n_slots=2, table_chunks=2)
    for slot, chunks in enumerate(tables):
        q8.set_table(slot, chunks)
    for rows, values, scales in zip(old, (q8.k[0], q8.v[0]), (q8.k_scale[0], q8.v_scale[0])):
        qv, sv = quantize_int8(rows)
        values.copy_(qv.view_as(values))
        scales.copy_(sv.view_as(scales))
    got8 = Step(batch, q8, cos, sin, hidden, heads, eps, hd**-0.5, fns).run(layer, 0, None, x)
    new = [cells + 2, 4]
    for rows, values, scales in zip((kv.k[0], kv.v[0]), (q8.k[0], q8.v[0]), (q8.k_scale[0], q8.v_scale[0])):
        qv, sv = quantize_int8(rows.reshape(-1, kv_heads, hd)[new])
        if not (torch.equal(values.reshape(-1, kv_heads, hd)[new], qv)
                and torch.equal(scales.reshape(-1, kv_heads)[new], sv)):
            raise KernelRefused("strata_decode_layer disagrees with torch's quantize_int8 on new K/V rows")
    if (got8 - got).abs().max() > 0.05 * got.abs().max():
        raise KernelRefused(f"strata_decode_layer over int8 K/V disagrees with float32 K/V by "
                            f"{(got8 - got).abs().max().item():.2e}")
    # Rule 5: both layers in one call are the two calls one after the other, bit for bit.
    one_by_one = step.run(split, 0, None, step.run(layer, 0, None, x).clone()).clone()
    if not torch.equal(step.run_all([layer, split], [0, 0], [None, None], x), one_by_one):
        raise KernelRefused("strata_decode_layers disagrees with strata_decode_layer called layer by layer")
    # Rule 6: the final norm and a head in one call are the layer ops' norm and the head's own product, bit for bit.
    head = Head.of(w["input_layernorm.weight"], w["qkv.weight"], hidden)
    normed = cpu_ops.rms_norm(x, w["input_layernorm.weight"], eps)
    if head is None or normed is None or not torch.equal(step.logits(head, x), w["qkv.weight"](normed[1])):
        raise KernelRefused("strata_decode_head disagrees with the norm and the product called one by one")
