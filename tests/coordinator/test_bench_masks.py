"""`strata bench masks` on a small trained tokenizer: every grammar the API builds is walked to its end or the
token cap, and every figure is there."""
from __future__ import annotations

import json

from coordinator.bench import main


def test_the_mask_bench_walks_every_grammar(tmp_path, capsys):
    assert main(["masks", "--vocab", "600", "--tokens", "24", "--walks", "1", "--out", str(tmp_path),
                 "--no-plot"]) == 0
    result = json.loads((tmp_path / "masks.json").read_text())
    assert [r["grammar"] for r in result["rows"]] == ["json_object", "json_schema", "tool_call", "think+json"]
    for row in result["rows"]:
        assert 0 < row["tokens"] <= 24 and row["vocab"] == 600
        assert 0 < row["per_token_p50_us"] <= row["per_token_p90_us"] <= row["per_token_max_us"]
    assert "strata bench masks" in capsys.readouterr().out
