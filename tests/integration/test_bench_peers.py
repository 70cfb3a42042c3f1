"""`strata bench peers` end to end on a tiny checkpoint: Strata through `strata up` beside transformers, both
measured, and Strata's greedy tokens equal transformers'."""
from __future__ import annotations

import json

import pytest

from coordinator.bench import main


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_peers_run_strata_and_transformers_on_one_checkpoint(tmp_path, arch):
    assert main(["peers", "--arch", arch, "--layers", "4", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                 "--intermediate", "128", "--prompt-tokens", "16", "--output-tokens", "4", "--concurrency", "1",
                 "--repeats", "1", "--threads", "2", "--peers", "strata-2,transformers", "--out", str(tmp_path),
                 "--no-plot"]) == 0
    result = json.loads((tmp_path / "peers.json").read_text())
    assert {r["peer"] for r in result["rows"]} == {"strata-2", "transformers"}, result["notes"]
    assert all(r["decode_tok_s"] > 0 for r in result["rows"])
    assert any("greedy check: Strata's first 4 greedy tokens equal transformers'" in n for n in result["notes"]), \
        result["notes"]
