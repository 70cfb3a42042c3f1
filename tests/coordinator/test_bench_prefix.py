"""`strata bench prefix`: its config, prompts, counting and refusals (the run itself needs a box: the command is
in docs/BATCHING.md)."""
from __future__ import annotations

from pathlib import Path

from coordinator.bench import build_parser, main
from coordinator.bench.prefix import box_config, held_whole, prompts
from pool.config import config_from_dict


def args(*argv: str):
    return build_parser().parse_args(["prefix", *argv])


def test_the_box_holds_fit_conversations_without_sharing():
    a = args("--prefix-tokens", "1000", "--suffix-tokens", "40", "--output-tokens", "8", "--fit", "3",
             "--conversations", "5", "--chunk-cells", "64")
    on, off = box_config(a, True, 8123, Path("/tmp/x")), box_config(a, False, 8123, Path("/tmp/x"))
    assert on["engine"] == {"max_context": 1088, "parallel": 5, "kv_pool_tokens": 3264, "chunk_cells": 64,
                            "prefill_chunk": 512, "threads": 0, "max_waiting": 10, "share_prefixes": True}
    assert off["engine"]["share_prefixes"] is False and {**off["engine"], "share_prefixes": True} == on["engine"]
    assert [s["layers"] for s in on["stages"]] == [[0, 2], [2, 4]]
    cfg = config_from_dict(on)
    assert cfg.engine.n_chunks == 3 * 17 and cfg.engine.share_prefixes


def test_prompts_share_exactly_the_prefix():
    a = args("--prefix-tokens", "100", "--suffix-tokens", "7", "--conversations", "4")
    ps = prompts(a)
    assert len(ps) == 5 and all(len(p) == 107 for p in ps)
    assert all(p[:100] == ps[0][:100] for p in ps)
    assert [p[100] for p in ps] == [5, 6, 7, 8, 9]  # each suffix starts with its own id
    assert prompts(a) == ps and all(5 <= t < 500 for p in ps for t in p)


def test_held_whole_counts_slots_and_parked_tables():
    pool = {"slots": [{"state": "held", "tokens": 120}, {"state": "busy", "tokens": 500},
                      {"state": "held", "tokens": 99}, {"state": "free", "tokens": 0}],
            "parked": [{"table": 9, "tokens": 107}, {"table": 10, "tokens": 100}]}
    assert held_whole(pool, 107) == 2


def test_a_shape_it_cannot_run_is_refused_naming_the_flag(capsys):
    assert main(["prefix", "--conversations", "1"]) == 1
    assert "strata bench prefix: --conversations must be at least 2, got 1" in capsys.readouterr().err
    assert main(["prefix", "--fit", "0"]) == 1
    assert "--fit must be at least 1, got 0" in capsys.readouterr().err
