"""`strata bench peers` end to end on a tiny checkpoint: Strata through `strata up` beside transformers, both
measured, and Strata's greedy tokens equal transformers'."""
from __future__ import annotations

import json

import pytest

from coordinator.bench import main


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_peers_run_strata_and_transformers_on_one_checkpoint(tmp_path, arch):
    assert main(["peers", "--arch", arch, "--layers", "4", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                 "--intermediate", "128", "--prompt-tokens", "16", "--output-tokens", "12", "--concurrency", "1",
                 "--repeats", "2", "--threads", "2", "--peers", "strata-2,transformers", "--out", str(tmp_path),
                 "--no-plot"]) == 0  # 11 decode steps beyond the first token: a decode time well above the noise
    result = json.loads((tmp_path / "peers.json").read_text())
    assert {r["peer"] for r in result["rows"]} == {"strata-2", "transformers"}, result["notes"]
    assert all(r["decode_tok_s"] > 0 for r in result["rows"])
    assert any("greedy check: Strata's first 12 greedy tokens equal transformers'" in n for n in result["notes"]), \
        result["notes"]


def test_peers_mixed_workload_on_two_stages_reports_each_stages_busy_share(tmp_path):
    """The mixed workload against `strata up` on 2 stages, in turns and pipelined: every request answered with all
    its tokens (usage), each stage's busy share of the makespan from the stages' own counters, the bubble against
    the steps computed at once, and the greedy check."""
    assert main(["peers", "--workload", "mixed", "--layers", "4", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                 "--intermediate", "128", "--prompt-tokens", "16", "--output-tokens", "6", "--requests", "8",
                 "--prompt-range", "8-200", "--output-range", "2-16", "--slots", "4", "--threads", "2",
                 "--peers", "strata-2,strata-2p", "--out", str(tmp_path), "--no-plot"]) == 0
    result = json.loads((tmp_path / "peers.json").read_text())
    turns, piped = result["rows"]
    for row, groups in ((turns, 1), (piped, 2)):  # in turns (pool/pipeline.py) one stage computes at a time
        assert row["failed"] == 0 and row["short"] == 0, result["notes"]
        busy = [float(f) for f in row["stage_busy"].split()]
        assert len(busy) == 2 and all(0 < f <= 1.05 for f in busy), row
        assert row["bubble"] == pytest.approx(1 - sum(busy) / groups, abs=0.01)
        assert 0 < row["coord_ms_tok"] < 1000, row  # the coordinator's CPU per output token, from its live view
    assert (turns["peer"], piped["peer"]) == ("strata-2", "strata-2p")
    assert "stage_busy" in result["columns"]
    assert any("strata-2: 2 CPU stage(s), engine.pipeline auto, engine.threads 2 each" in n for n in result["notes"])
    assert any("strata-2p: 2 CPU stage(s), engine.pipeline True, engine.threads 1 each" in n for n in result["notes"])
    assert any("greedy check: Strata's first 6 greedy tokens equal transformers'" in n for n in result["notes"]), \
        result["notes"]


def _llama_server() -> str | None:
    from stages.llama_server import find_binary

    found = find_binary()
    return str(found) if found else None


@pytest.mark.skipif(_llama_server() is None, reason="llama-server is not built (python -m stages.bench_peers "
                                                    "build-llama-server); CI never builds it")
def test_peers_mixed_workload_on_strata_and_llama_server(tmp_path):
    assert main(["peers", "--workload", "mixed", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                 "--intermediate", "128", "--prompt-tokens", "16", "--output-tokens", "6", "--requests", "6",
                 "--prompt-range", "8-48", "--output-range", "2-8", "--slots", "2", "--threads", "2",
                 "--peers", "strata-1,llama-server,llama-server-f32", "--out", str(tmp_path), "--no-plot"]) == 0
    result = json.loads((tmp_path / "peers.json").read_text())
    rows = {r["peer"]: r for r in result["rows"]}
    assert set(rows) == {"strata-1", "llama-server", "llama-server-f32"}, result["notes"]
    for row in rows.values():
        assert row["requests"] == 6 and row["failed"] == 0 and row["short"] == 0, result["notes"]
        assert row["makespan_s"] > 0 and row["out_tok_s"] > 0
    assert rows["strata-1"]["output_tokens"] == rows["llama-server"]["output_tokens"]  # from usage, same workload
    assert rows["strata-1"]["prompt_tokens"] == rows["llama-server"]["prompt_tokens"]
    assert rows["llama-server"]["out_tok_s_vs_ls"] == 1.0
    notes = "\n".join(result["notes"])
    assert "greedy check: Strata's first 6 greedy tokens equal transformers'" in notes, notes
    for peer in ("llama-server", "llama-server-f32"):
        assert f"greedy check: {peer}'s" in notes and f"{peer}'s greedy token ids DIFFER" not in notes \
            and f"{peer}'s first 6 greedy token ids DIFFER" not in notes, notes
