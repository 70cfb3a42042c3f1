"""A quantized GGUF file served whole: `strata up` on a Q4_K_M file, requests through the official client, the
tokens checked against transformers on the dequantized weights (tests/stages/gguf_files.py)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.integration.conftest import Server, oracle_decode, oracle_greedy
from tests.stages.gguf_files import write_dequantized_checkpoint, write_gguf

pytest.importorskip("gguf")

MODEL = {"arch": "qwen3", "layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512, "seed": 7}


@pytest.fixture(scope="module")
def quantized_box(tiny_model_factory):
    """One CPU stage on the Q4_K_M file of MODEL (its output table Q6_K, held as bytes), prompt pieces of 64
    tokens, 8-bit activations off (so decode steps compute what transformers does); and the checkpoint of the
    dequantized weights."""
    root = Path(tempfile.mkdtemp(prefix="sq", dir="/tmp"))
    hf = tiny_model_factory(**MODEL)
    path = write_gguf(hf, root / "m-Q4_K_M.gguf", "Q4_K_M")
    oracle = write_dequantized_checkpoint(hf, "Q4_K_M", root / "dequantized")
    server = Server(root, path, {"prefill_chunk": 64, "int8_activations": False, "dtype": "float32"}, n_stages=1)
    try:
        server.start()
        yield server, oracle
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_lone_prompt_longer_than_a_piece_is_answered_as_transformers(quantized_box) -> None:
    """A 150-token prompt alone is three pieces; the first two sample nothing and are the only work of their steps
    (no head to run: the byte-rows head refused a product of no rows, a 500), the answer is transformers' greedy
    continuation on the dequantized weights, and every cell is free afterwards."""
    server, oracle = quantized_box
    prompt = [(i * 37 + 11) % 500 + 5 for i in range(150)]
    want, ended = oracle_greedy(oracle, prompt, 6)
    got = server.openai().completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=0,
                                             logprobs=1)
    assert got.usage.prompt_tokens == 150
    choice = got.choices[0]
    assert choice.finish_reason == ("stop" if ended else "length")
    assert choice.logprobs.tokens == [oracle_decode(oracle, [t]) for t in want]
    server.check_clean()
