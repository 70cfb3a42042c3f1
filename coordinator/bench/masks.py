"""`strata bench masks`: what a grammar mask costs the coordinator per sampled token (coordinator/grammar.py).

    strata bench masks --vocab 32000 --tokens 256 --walks 4

The tokenizer is a checkpoint's (`--model DIR`), or a byte-level BPE of at most `--vocab` tokens trained here on
this project's own source and docs and Python's standard library (a vocabulary the size of a real model's: the
mask's cost grows with it). For each grammar the API builds (json_object, a strict json_schema, a forced hermes tool call, a thinking section with a
budget before a JSON answer), `--walks` random walks sample uniformly among the allowed ids until eos or
`--tokens`, timing per token what the scheduler's worker thread does per sampled token: `advance(token)` then
`mask()`. Figures: the Matcher's build time, and the per-token cost (median, p90, max), in microseconds; the
last column is the share of a 20 ms decode step (a 7-8B model on one consumer GPU) the median would take if it
were not overlapped with the step (the scheduler computes masks in worker threads while steps run).
"""
from __future__ import annotations

import argparse
import json
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from .report import median, percentile

STEP_MS = 20.0
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"],
          "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"},
                         "unit": {"enum": ["C", "F"]}, "notes": {"type": "array", "items": {"type": "string"}}}}


def _trained_tokenizer(vocab: int, root: Path) -> Path:
    """A byte-level BPE of `vocab` tokens on this project's text, saved as a checkpoint-like directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    project = Path(__file__).resolve().parents[2]
    files = [str(p) for p in sorted(project.rglob("*")) if p.suffix in (".py", ".md", ".yaml")
             and ".venv" not in p.parts and p.is_file()]
    files += [str(p) for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
              if "site-packages" not in p.parts and "test" not in p.parts]  # text enough for 32k merges
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<think>", "</think>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return root


def _grammars() -> dict[str, tuple[str, Any]]:
    from .. import grammar as g
    from ..thinking_budget import SectionBudget

    tools = [{"name": "get_weather", "description": "Weather by city", "parameters": SCHEMA}, {"name": "ping"}]
    return {
        "json_object": (g.json_object(), None),
        "json_schema": (g.json_schema(SCHEMA, strict=True), None),
        "tool_call": (g.tool_calls("hermes", tools, "required", True), None),
        "think+json": (g.after_reasoning(g.json_schema(SCHEMA, strict=True), True, "<think>", "</think>"),
                       SectionBudget(64, opened=True)),
    }


def _walk(gt: Any, tok: Any, grammar: str, budget: Any, tokens: int, rng: Any) -> tuple[float, list[float]]:
    """(build ms, per-token µs) of one random walk."""
    import numpy as np

    from ..grammar import Matcher

    t0 = time.perf_counter()
    m = Matcher(gt, grammar, budget=gt.budget(budget, tok) if budget is not None else None)
    mask = m.mask()
    build_ms = (time.perf_counter() - t0) * 1e3
    costs = []
    for _ in range(tokens):
        ids = np.nonzero(np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little"))[0]
        token = int(rng.choice(ids))
        if token in gt.eos_ids:
            break
        t0 = time.perf_counter()
        mask = m.advance_and_mask(token)
        costs.append((time.perf_counter() - t0) * 1e6)
    return build_ms, costs


def run_masks(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from ..grammar import GrammarTokenizer
    from ..tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(prefix="strata-bench-masks-") as tmp:
        where = Path(args.model) if args.model else _trained_tokenizer(args.vocab, Path(tmp) / "tok")
        tok = Tokenizer.from_dir(where)
        gt = GrammarTokenizer.for_tokenizer(tok, tok.vocab_size)
        rows = []
        for name, (grammar, budget) in _grammars().items():
            rng = np.random.default_rng(args.seed)
            builds, costs = [], []
            for _ in range(args.walks):
                b, c = _walk(gt, tok, grammar, budget, args.tokens, rng)
                builds.append(b)
                costs.extend(c)
            p50 = median(costs)
            rows.append({"grammar": name, "vocab": tok.vocab_size, "tokens": len(costs),
                         "build_ms": round(median(builds), 2), "per_token_p50_us": round(p50, 1),
                         "per_token_p90_us": round(percentile(costs, 90), 1),
                         "per_token_max_us": round(max(costs), 1),
                         "p50_of_20ms_step": f"{p50 / (STEP_MS * 1e3):.2%}"})
    trained = f"byte-level BPE trained to at most {args.vocab} tokens on the project text and the stdlib"
    return {
        "bench": "masks",
        "columns": ["grammar", "vocab", "tokens", "build_ms", "per_token_p50_us", "per_token_p90_us",
                    "per_token_max_us", "p50_of_20ms_step"],
        "rows": rows,
        "plot": {"x": "grammar", "series": [],
                 "panels": [{"y": ["per_token_p50_us", "per_token_p90_us"], "ylabel": "µs per token",
                             "kind": "bar"}]},
        "notes": [f"tokenizer: {args.model or trained}; {args.walks} random walks of at most {args.tokens} tokens "
                  f"per grammar, seed {args.seed}",
                  "per token: Matcher.advance(token) + mask(), what a worker thread does per sampled token"],
    }
