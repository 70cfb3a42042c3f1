"""GGUF files against llama.cpp, the reference engine for the format: the same file's logits, per format.

Oracle: llama.cpp (llama-cpp-python, in a child process, every position's logits), on the file the test writes
(tests/stages/gguf_files.py). Per format: greedy top-1 agreement over every position of a few prompts and the
largest log-probability difference, for Strata in float32 (the dequantized weights, exactly) and in bfloat16
(the int4 kernel and the bfloat16 GEMM path). llama.cpp multiplies quantized weights by activations it quantizes
to 8 bits itself, so even float32 differs by a little; the thresholds are set from the measurement (module
constants). Skipped where llama-cpp-python is not installed (it builds llama.cpp from source, minutes: not in
CI); `pip install llama-cpp-python` then run this file.

llama.cpp's extra CPU buffer types (AMX, repacked quant blocks) crash on these tiny files on some machines, so it
loads without them (`use_extra_bufts` false): its plain CPU kernels, the same quantized arithmetic.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from tests.stages.test_gguf import NEXT_K, SHAPE_K, files, stage_logits  # noqa: F401  (files: the fixture)

pytest.importorskip("llama_cpp")

PROMPTS = [[random.Random(f"p{i}").randrange(500) for _ in range(24)] for i in range(4)]
# format -> (top-1 agreement at least, max |log-prob difference| at most) for float32, then bfloat16. Measured on
# this suite's files (qwen3 and llama, 2 layers, hidden 256; 96 positions), llama.cpp 0.3.36 on x86 CPU:
#   F32   float32 1.000 / 0.0026   bfloat16 1.000 / 0.094
#   Q8_0  float32 1.000 / 0.128    bfloat16 1.000 / 0.145
#   Q4_0  float32 0.979 / 0.140    bfloat16 0.750 / 0.166
#   Q4_K  float32 0.865-1.0 / 0.19-0.20   bfloat16 0.865-1.0 / 0.21-0.22
# A random model's top-2 logits are often near ties, so top-1 is the looser figure at 4 bits; the log-prob
# difference of float32 against llama.cpp is llama.cpp's own 8-bit activations (0.0026 with float weights).
THRESHOLDS = {"F32": (0.99, 0.01, 0.95, 0.2), "Q8_0": (0.97, 0.25, 0.95, 0.3), "Q4_0": (0.9, 0.3, 0.7, 0.35),
              "Q4_K": (0.8, 0.4, 0.8, 0.4)}

_CHILD = """
import json, sys
import llama_cpp
from stages.bench_peers import without_extra_bufts
without_extra_bufts(llama_cpp)
path, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = llama_cpp.Llama(path, n_ctx=64, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False)
out = []
for p in prompts:
    llm.reset()
    llm.eval(p)
    out.append([list(map(float, llm.scores[i])) for i in range(len(p))])
print(json.dumps(out))
"""


def llama_logits(path) -> list[torch.Tensor]:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path), json.dumps(PROMPTS)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return [torch.tensor(x) for x in json.loads(done.stdout)]


def compare(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    a, b = torch.cat(ours), torch.cat(ref)
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    diff = (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().max().item()
    return top1, diff


@pytest.mark.parametrize("arch,qtype", [("qwen3", "F32"), ("qwen3", "Q8_0"), ("qwen3", "Q4_0"), ("qwen3", "Q4_K"),
                                        ("llama", "Q4_K")])
def test_logits_agree_with_llama_cpp(files, arch: str, qtype: str) -> None:
    path, _ = files(arch, qtype, SHAPE_K)
    ref = llama_logits(path)
    f32 = compare([stage_logits(path, [1], p) for p in PROMPTS], ref)
    bf16 = compare([stage_logits(path, [], p, torch.bfloat16) for p in PROMPTS], ref)
    print(f"{arch} {qtype}: float32 top-1 {f32[0]:.3f} max |dlogp| {f32[1]:.4f}; "
          f"bfloat16 top-1 {bf16[0]:.3f} max |dlogp| {bf16[1]:.4f}")
    t32, d32, tb, db = THRESHOLDS[qtype]
    assert f32[0] >= t32 and f32[1] <= d32
    assert bf16[0] >= tb and bf16[1] <= db


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0", "Q4_K"])
def test_qwen3_next_logits_agree_with_llama_cpp(files, qtype: str) -> None:
    """qwen3next (3 Gated DeltaNet layers and a gated full-attention one, MoE with a shared expert), the file as
    llama.cpp's converter lays it out. F32: the same logits (measured top-1 1.000, max |dlogp| 0.0014), which pins
    every reshaped tensor, the geometry and the layer kinds. Quantized: this random hybrid turns small changes of
    its activations into large ones (Strata's own bfloat16 differs from its float32 by 2.1-3.4 in log-prob on the
    same file), so llama.cpp's 8-bit activations bound the agreement; it must stay within that model's own
    bfloat16 spread (measured: top-1 0.72-0.84, max |dlogp| 2.3-3.1, 0.8-1.1x the spread; thresholds 0.6, 1.5x)."""
    path, _ = files("qwen3_next", qtype, NEXT_K)
    ref = llama_logits(path)
    ours = [stage_logits(path, [1], p) for p in PROMPTS]
    f32 = compare(ours, ref)
    spread = compare([stage_logits(path, [], p, torch.bfloat16) for p in PROMPTS], ours)
    print(f"qwen3_next {qtype}: float32 top-1 {f32[0]:.3f} max |dlogp| {f32[1]:.4f}; own bfloat16 spread "
          f"{spread[1]:.4f}")
    if qtype == "F32":
        assert f32[0] >= 0.99 and f32[1] <= 0.01
    else:
        assert f32[0] >= 0.6 and f32[1] <= 1.5 * spread[1]
