"""What the stages compute: one list for the stage that refuses a checkpoint at load (stages/checkpoint.py,
stages/rope.py) and for `strata config check`, which refuses it before anything starts (coordinator/
config_check.py; the coordinator does not import the stage package). No torch here.

`uncomputable(config)` names the first of: an architecture outside SUPPORTED_ARCHS, a `hidden_act` outside
SUPPORTED_ACTS, any `quantization_config` (FP8 blocks, GPTQ, AWQ, ...: the stages compute plain float weights);
None when none applies. The rope is checked by each side as it reads it.
"""
from __future__ import annotations

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                   "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ACTS = ("silu",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Stored dtypes a float tensor may be cast from; anything else (F8_E4M3 with its block scales, I8, ...) would be
# read as plain numbers without the scheme that gives them meaning.
FLOAT_ST_DTYPES = ("F64", "F32", "F16", "BF16")


def uncomputable(config: dict) -> str | None:
    """Why the stages cannot compute this config.json (the module rules), or None."""
    arch = (config.get("architectures") or [None])[0]
    if arch not in SUPPORTED_ARCHS:
        return f"architecture {arch!r} is not computed by the stages (supported: {', '.join(SUPPORTED_ARCHS)})"
    act = config.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTS:
        return f"hidden_act {act!r} is not computed by the stages (only {', '.join(SUPPORTED_ACTS)})"
    quant = config.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        return (f"quantization_config quant_method={method} is not computed by the stages; use an unquantized "
                "(float32/bfloat16/float16) checkpoint")
    return None
