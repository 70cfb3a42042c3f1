"""What the stages compute: one list for the stage that refuses a checkpoint at load (stages/checkpoint.py,
stages/rope.py) and for `strata config check`, which refuses it before anything starts (coordinator/
config_check.py; the coordinator does not import the stage package). No torch here.

`uncomputable(config)` names the first of: an architecture outside SUPPORTED_ARCHS, a `hidden_act` outside
SUPPORTED_ACTS, a `quantization_config` other than block-scaled FP8 (`fp8_blocks`: quant_method fp8, fmt e4m3,
a 2-int weight_block_size; its `*.weight` stored F8_E4M3 beside a float32 `*.weight_scale_inv` of one scale
per block, dequantized at load as `w * scale` per block) and the integer schemes of `int4_scheme` (GPTQ 4/8-bit,
AWQ gemm 4-bit: stages/int4_checkpoint.py); anything else (bitsandbytes, GPTQ 2/3-bit, AWQ gemv, ...) is refused
by name,
a layer kind or linear-attention geometry the stages do not compute (pool/layer_kinds.py); None when none
applies. The rope is checked by each side as it reads it; a partial rotary factor only for the architectures of
PARTIAL_ROTARY_ARCHS (which rotate the first `head_dim * factor` dims of each head; the others rotate all).
"""
from __future__ import annotations

from functools import lru_cache

from pool.layer_kinds import linear_problem

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                   "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM")
# Architectures whose rotary embedding covers a fraction of each head -> the factor their config defaults to.
PARTIAL_ROTARY_ARCHS = {"Qwen3NextForCausalLM": 0.25}
SUPPORTED_ACTS = ("silu",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Stored dtypes a float tensor may be cast from; anything else (F8_E4M3 with its block scales, I8, ...) would be
# read as plain numbers without the scheme that gives them meaning.
FLOAT_ST_DTYPES = ("F64", "F32", "F16", "BF16")
FP8_ST_DTYPE = "F8_E4M3"  # a block-scaled FP8 checkpoint's weights (fp8_blocks)
INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # a GPTQ / AWQ linear's stored tensors (int4_scheme)
INT4_KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes torch's int4 weight-only kernels take


def keeps_int4(dtype: str, device_kind: str) -> bool:
    """Whether a stage on this kind of device keeps int4 planes packed in this compute dtype (stages/quant_linear.py):
    bfloat16 everywhere (the CUDA kernel's only dtype), float32 and float16 on the CPU too; else dequantized."""
    return dtype == "bfloat16" or (device_kind == "cpu" and dtype in ("float32", "float16"))


# oneDNN multiplies bfloat16 / float16 natively (as torch.ops.mkldnn._is_mkldnn_bf16_supported / _fp16_ asks) with
# any one of these sets of /proc/cpuinfo flags; without them torch converts every product through float32.
NATIVE_16BIT_FLAGS = {"bfloat16": ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"}, {"amx_bf16"}),
                      "float16": ({"avx512_fp16"}, {"avx_ne_convert"}, {"amx_fp16"})}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's flags from /proc/cpuinfo (empty where there is none), read once."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def native_16bit(dtype: str, flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or `flags`) multiplies the 16-bit `dtype` natively (NATIVE_16BIT_FLAGS)."""
    flags = cpu_flags() if flags is None else flags
    return any(need <= flags for need in NATIVE_16BIT_FLAGS.get(dtype, ()))


def auto_dtype(stored: str, device_kinds: list[str], flags: frozenset[str] | None = None) -> str:
    """`engine.dtype: auto`: the checkpoint's dtype (`stored`; a quantized GGUF's is bfloat16), except float32 for a
    box whose stages are all on the CPU when that CPU has no native products in the 16-bit dtype
    (NATIVE_16BIT_FLAGS): there torch converts each product through float32, a [3072, 768] weight by 128 rows 6.6x
    slower than in float32 and 17x more again for a transposed one (docs/BENCHMARKS.md, "AVX2 CPUs"), so a prompt
    of a quantized model took over 40 s. The stage (stages/runner.py) and `strata config check` resolve it alike."""
    if stored not in NATIVE_16BIT_FLAGS or not device_kinds or any(d != "cpu" for d in device_kinds):
        return stored
    return stored if native_16bit(stored, flags) else "float32"


def int4_scheme(config: dict) -> dict | None:
    """{"method": gptq | awq, "bits", "group", "format"} of a GPTQ / AWQ checkpoint the stages compute, else None."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    method, bits, group = quant.get("quant_method"), quant.get("bits"), quant.get("group_size", 128)
    if not isinstance(group, int) or not (group == -1 or group > 0):
        return None
    if method == "gptq" and bits in (4, 8):
        fmt = quant.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            return None
        return {"method": "gptq", "bits": bits, "group": group, "format": fmt}
    if method == "awq" and bits == 4 and str(quant.get("version", "gemm")).lower() == "gemm" \
            and quant.get("zero_point", True):
        return {"method": "awq", "bits": 4, "group": group, "format": "gemm"}
    return None


def fp8_blocks(config: dict) -> tuple[int, int] | None:
    """(rows, cols) of a block-scaled FP8 checkpoint's scale blocks (DeepSeek / Qwen FP8 releases), else None."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if quant.get("fmt", "e4m3") != "e4m3" or not (isinstance(block, list) and len(block) == 2
                                                    and all(isinstance(b, int) and b > 0 for b in block)):
        return None
    return block[0], block[1]


def uncomputable(config: dict) -> str | None:
    """Why the stages cannot compute this config.json (the module rules), or None."""
    arch = (config.get("architectures") or [None])[0]
    if arch not in SUPPORTED_ARCHS:
        return f"architecture {arch!r} is not computed by the stages (supported: {', '.join(SUPPORTED_ARCHS)})"
    act = config.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTS:
        return f"hidden_act {act!r} is not computed by the stages (only {', '.join(SUPPORTED_ACTS)})"
    quant = config.get("quantization_config")
    if quant is not None and fp8_blocks(config) is None and int4_scheme(config) is None:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        parts = [f"{k}={quant[k]}" for k in ("bits", "version", "checkpoint_format", "fmt")
                 if isinstance(quant, dict) and k in quant]
        if method == "fp8" and isinstance(quant, dict) and "weight_block_size" not in quant:
            parts.append("no weight_block_size")
        detail = ", ".join(parts)
        return (f"quantization_config quant_method={method}{' (' + detail + ')' if detail else ''} is not computed "
                "by the stages (computed: block-scaled fp8 e4m3, GPTQ 4/8-bit, AWQ gemm 4-bit, GGUF files); use one "
                "of those or an unquantized checkpoint")
    return linear_problem(config)


def rotary_factor(config: dict) -> float:
    """The fraction of each head the rotary embedding covers: `partial_rotary_factor` in `rope_parameters` (or
    `rope_scaling`), else at the top level, else the architecture's default (PARTIAL_ROTARY_ARCHS), else 1.0."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    arch = (config.get("architectures") or [None])[0]
    default = PARTIAL_ROTARY_ARCHS.get(arch, 1.0)
    return float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", default)))


def rotary_problem(config: dict) -> str | None:
    """Why the stages cannot rotate this config's heads (a partial factor outside PARTIAL_ROTARY_ARCHS, or one
    that leaves an odd or empty rotary part of the head), or None."""
    factor = rotary_factor(config)
    if factor == 1.0:
        return None
    arch = (config.get("architectures") or [None])[0]
    if arch not in PARTIAL_ROTARY_ARCHS:
        return f"partial_rotary_factor={factor} is not computed by the stages for {arch} (only 1.0)"
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dim = int(head_dim * factor)
    if not 0 < factor <= 1 or dim < 2 or dim % 2:
        return (f"partial_rotary_factor={factor} gives a rotary part of {dim} of head_dim {head_dim}; it must be "
                "even and at least 2")
    return None
