"""pool/config.py: every refusal names its key; overrides; YAML errors; the fingerprint."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pool import step_chain
from pool.config import Config, ConfigError, apply_overrides, config_from_dict, default_config_path, load_config

REPO = Path(__file__).resolve().parents[2]


def _stages(*ranges: tuple[int, int], scheme: str = "ipc") -> list[dict]:
    if scheme == "tcp":
        return [{"layers": list(r), "endpoint": f"tcp://127.0.0.1:{5000 + 10 * i}"} for i, r in enumerate(ranges)]
    return [{"layers": list(r), "endpoint": f"ipc:///tmp/t-stage-{i}"} for i, r in enumerate(ranges)]


def _refused(data: dict, overrides: list[str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, overrides)
    return info.value


# --- the shipped configs ---------------------------------------------------------------------------------

def test_cpu_tiny_is_the_embedded_default() -> None:
    cfg = load_config(default_config_path())
    assert default_config_path() == REPO / "configs" / "cpu-tiny.yaml"
    assert cfg.model == "tiny"
    assert [s.layers for s in cfg.stages] == [(0, 2), (2, 4)]
    assert all(s.device == "cpu" and s.endpoint.startswith("ipc:///tmp/") for s in cfg.stages)
    assert (cfg.coordinator.host, cfg.coordinator.port) == ("127.0.0.1", 8080)
    e = cfg.engine
    assert (e.max_context, e.parallel, e.kv_pool_tokens, e.chunk_cells) == (4096, 4, 16384, 256)
    assert (e.pool_on, e.n_chunks, e.table_chunks) == (True, 64, 16)
    assert cfg.notes() == []


def test_dual_3080() -> None:
    cfg = load_config(REPO / "configs" / "dual-3080.yaml")
    assert [(s.device, s.layers) for s in cfg.stages] == [("cuda:0", (0, 20)), ("cuda:1", (20, 40))]
    e = cfg.engine
    assert (e.max_context, e.parallel, e.kv_pool_tokens, e.kv_dtype, e.chunk_cells) == (131072, 4, 524288, "int8", 4096)
    assert (e.n_chunks, e.table_chunks, e.device_cells) == (128, 32, 81920)
    assert cfg.stages[1].data == "ipc:///run/strata/stage-1-data"
    cfg.check_layers(40)


# --- refusals, each naming its key -----------------------------------------------------------------------

@pytest.mark.parametrize(
    "data, key, words",
    [
        ({"engnie": {}}, "engnie", "unknown key (did you mean engine?)"),
        ({"engine": {"max_contxt": 10}}, "engine.max_contxt", "did you mean max_context?"),
        ({"stages": [{"layers": [0, 4], "endpoint": "ipc:///tmp/a", "devcie": 0}]}, "stages.0.devcie", "unknown key"),
        ({"engine": {"parallel": "four"}}, "engine.parallel", "valid integer"),
        ({"engine": {"kv_dtype": "fp8"}}, "engine.kv_dtype", "'auto' or 'int8'"),
        ({"engine": {"parallel": 0}}, "engine.parallel", "greater than or equal to 1"),
        ({"coordinator": {"port": 70000}}, "coordinator.port", "less than or equal to 65535"),
        ({"coordinator": {"api_key": " "}}, "coordinator.api_key", "use null"),
        ({"coordinator": {"heartbeat_ms": 2000}}, "coordinator.heartbeat_ms", "stage_timeout_ms=1500"),
        ({"engine": {"max_context": 4096, "prefill_chunk": 8192}}, "engine.prefill_chunk", "max_context=4096"),
        ({"engine": {"max_context": 8192, "chunk_cells": 1024, "kv_pool_tokens": 4096}}, "engine.kv_pool_tokens",
         "smaller than one engine.max_context=8192"),
        ({"model": ""}, "model", "at least 1 character"),
        ({"stages": []}, "stages", "at least one stage"),
        ({"stages": [{"layers": [0, 4]}]}, "stages.0.endpoint", "Field required"),
        ({"stages": [{"layers": [3, 3], "endpoint": "ipc:///tmp/a"}]}, "stages.0.layers", "empty"),
        ({"stages": [{"layers": [0, 4], "endpoint": "ipc:///tmp/a", "device": "gpu"}]}, "stages.0.device", "'cuda:N'"),
        ({"stages": _stages((2, 4), (0, 2))}, "stages.1.layers", "list the stages in layer order"),
        ({"stages": _stages((1, 4))}, "stages.0.layers", "layer 0 is not served"),
        ({"stages": _stages((0, 2), (3, 4))}, "stages.1.layers", "layer 2 is not served"),
        ({"stages": _stages((0, 2), (5, 8))}, "stages.1.layers", "layers 2..4 are not served"),
        ({"stages": _stages((0, 3), (2, 4))}, "stages.0.layers", "overlap (layer 2 is served twice)"),
        ({"stages": [{"layers": [0, 4], "endpoint": "tcp://127.0.0.1:70000"}]}, "stages.0.endpoint",
         "port 70000 is out of range"),
        ({"stages": [{"layers": [0, 4], "endpoint": "tcp://hostonly"}]}, "stages.0.endpoint", "tcp://host:port"),
        ({"stages": [{"layers": [0, 4], "endpoint": "inproc://x"}]}, "stages.0.endpoint", "use ipc:///path"),
        ({"stages": [{"layers": [0, 4], "endpoint": "ipc://"}]}, "stages.0.endpoint", "needs a socket path"),
        ({"stages": [{"layers": [0, 4], "endpoint": "ipc:///" + "x" * 107}]}, "stages.0.endpoint",
         "unix sockets allow 107"),
    ],
)
def test_refusals_name_the_key(data: dict, key: str, words: str) -> None:
    err = _refused(data)
    assert err.key == key
    assert key in str(err) and words in str(err), str(err)


def test_all_errors_reported_at_once() -> None:
    err = _refused({"engine": {"parallel": "four", "max_contxt": 1}, "coordinator": {"prot": 1}})
    text = str(err)
    assert "engine.parallel" in text and "engine.max_contxt" in text and "coordinator.prot" in text
    assert "(got 'four')" in text


def test_duplicate_endpoints() -> None:
    err = _refused({"stages": [{"layers": [0, 2], "endpoint": "ipc:///tmp/a"}, {"layers": [2, 4], "endpoint": "ipc:///tmp/a"}]})
    assert err.key == "stages.1.endpoint" and "already bound by stages.0.endpoint" in str(err)
    # A data endpoint (derived: tcp port + 1) colliding with the next stage's endpoint.
    stages = [{"layers": [0, 1], "endpoint": "tcp://127.0.0.1:5000"},
              {"layers": [1, 2], "endpoint": "tcp://127.0.0.1:5001"},
              {"layers": [2, 3], "endpoint": "tcp://127.0.0.1:5002"}]
    err = _refused({"stages": stages})
    assert err.key == "stages.2.endpoint" and "already bound by stages.1.data" in str(err)
    # Stage 0 receives nothing there by default: its derived data port may be the next stage's endpoint.
    two = config_from_dict({"stages": stages[:2]})
    assert two.engine.chain_steps == "auto" and not step_chain.enabled(two) and not step_chain.ring(two)
    # With chained steps on several stages it takes the last stage's samples there (pool/step_chain.py rule 6).
    err = _refused({"stages": stages[:2], "engine": {"chain_steps": True}})
    assert err.key == "stages.1.endpoint" and "already bound by stages.0.data" in str(err)
    assert "last stage's samples" in str(err) and "engine.chain_steps at auto" in str(err)
    one = config_from_dict({"stages": [stages[0]]})  # one stage: chained by default, no ring, nothing more bound
    assert step_chain.enabled(one) and not step_chain.ring(one)
    assert not step_chain.enabled(config_from_dict({"stages": [stages[0]], "engine": {"chain_steps": False}}))
    # An explicit data_endpoint equal to another stage's endpoint.
    stages = [{"layers": [0, 2], "endpoint": "ipc:///tmp/a"},
              {"layers": [2, 4], "endpoint": "ipc:///tmp/b", "data_endpoint": "ipc:///tmp/a"}]
    err = _refused({"stages": stages})
    assert err.key == "stages.1.data_endpoint" and "already bound by stages.0.endpoint" in str(err)


def test_derived_data_endpoint_must_be_valid() -> None:
    stages = [{"layers": [0, 2], "endpoint": "tcp://10.0.0.1:5000"}, {"layers": [2, 4], "endpoint": "tcp://10.0.0.2:65535"}]
    box = {"curve_dir": "/etc/strata/keys"}
    err = _refused({"stages": stages, "box": box})
    assert err.key == "stages.1.data" and "65536" in str(err) and "set stages.1.data_endpoint" in str(err)
    stages[1]["data_endpoint"] = "tcp://10.0.0.2:6000"
    assert config_from_dict({"stages": stages, "box": box}).stages[1].data == "tcp://10.0.0.2:6000"
    long_ipc = "ipc:///tmp/" + "x" * 100  # 105 bytes of path: fine, but not with "-data" after it
    err = _refused({"stages": [{"layers": [0, 2], "endpoint": "ipc:///tmp/a"}, {"layers": [2, 4], "endpoint": long_ipc}]})
    assert err.key == "stages.1.data" and "unix sockets allow 107" in str(err)


def test_stage_port_is_not_the_http_port() -> None:
    stage = {"layers": [0, 4], "endpoint": "tcp://127.0.0.1:8080"}
    err = _refused({"stages": [stage]})
    assert err.key == "stages.0.endpoint" and "coordinator.port=8080" in str(err)
    _refused({"coordinator": {"host": "0.0.0.0"}, "stages": [{**stage, "endpoint": "tcp://localhost:8080"}]})
    config_from_dict({"stages": [{**stage, "endpoint": "tcp://10.0.0.2:8080"}], "box": {"curve_dir": "/k"}})
    config_from_dict({"coordinator": {"port": 8000}, "stages": [stage]})


def test_device_spellings() -> None:
    cfg = config_from_dict({"stages": [{"layers": [0, 2], "endpoint": "ipc:///tmp/a", "device": 0},
                                       {"layers": [2, 4], "endpoint": "ipc:///tmp/b", "device": "1"},
                                       {"layers": [4, 6], "endpoint": "ipc:///tmp/c", "device": "cuda:1"}]})
    assert [s.device for s in cfg.stages] == ["cuda:0", "cuda:1", "cuda:1"]
    assert cfg.notes() == ["stages: several stages on cuda:1 share its memory"]


def test_check_layers_names_missing_and_extra_layers() -> None:
    cfg = config_from_dict({"stages": _stages((0, 2), (2, 4))})
    cfg.check_layers(4)
    with pytest.raises(ConfigError, match=r"stages.1.layers: .* 6 layers: layers 4..5 are not served by any stage"):
        cfg.check_layers(6)
    with pytest.raises(ConfigError, match=r"has 3 layers: layer 3 is not in the model"):
        cfg.check_layers(3)


def test_pool_rounds_up_to_whole_chunks_with_a_note() -> None:
    cfg = config_from_dict({"engine": {"max_context": 4096, "chunk_cells": 4096, "kv_pool_tokens": 10000}})
    assert cfg.engine.n_chunks == 3
    assert cfg.notes() == ["engine.kv_pool_tokens=10000 is not a multiple of engine.chunk_cells=4096: "
                           "rounded up to 3 chunks = 12288 cells"]
    # The smallest pool that holds one context is accepted; one chunk less is refused.
    config_from_dict({"engine": {"max_context": 1000, "chunk_cells": 100, "kv_pool_tokens": 901}})
    _refused({"engine": {"max_context": 1000, "chunk_cells": 100, "kv_pool_tokens": 900}})


def test_pool_no_smaller_than_baseline_is_noted() -> None:
    cfg = config_from_dict({"engine": {"max_context": 1024, "chunk_cells": 256, "parallel": 1, "kv_pool_tokens": 2048}})
    assert any("saves no memory" in n for n in cfg.notes())
    assert config_from_dict({"engine": {"chunk_cells": 16384, "max_context": 8192}}).notes() == [
        "engine.chunk_cells=16384 exceeds engine.max_context=8192: each table holds one partly used chunk"]


def test_pool_off_geometry() -> None:
    e = config_from_dict({"engine": {"max_context": 1000, "chunk_cells": 100, "parallel": 3}}).engine
    assert (e.pool_on, e.table_chunks, e.n_chunks) == (False, 10, 40)


# --- overrides ---------------------------------------------------------------------------------------------

def test_overrides_on_a_file(tmp_path: Path) -> None:
    path = tmp_path / "box.yaml"
    path.write_text("engine:\n  kv_pool_tokens: 16384\n  chunk_cells: 256\n  max_context: 4096\n"
                    "stages:\n  - {layers: [0, 2], endpoint: 'ipc:///tmp/a'}\n  - {layers: [2, 4], endpoint: 'ipc:///tmp/b'}\n")
    cfg = load_config(path, ["engine.kv_pool_tokens=8192", "stages.1.device=cuda:1", "coordinator.api_key=s3cret",
                             "stages.0.layers=[0, 3]", "stages.1.layers=[3,4]", "model=/srv/models/x"])
    assert cfg.engine.kv_pool_tokens == 8192 and cfg.engine.n_chunks == 32
    assert cfg.stages[1].device == "cuda:1" and cfg.stages[1].endpoint == "ipc:///tmp/b"
    assert [s.layers for s in cfg.stages] == [(0, 3), (3, 4)]
    assert (cfg.coordinator.api_key, cfg.model) == ("s3cret", "/srv/models/x")
    assert load_config(path, ["coordinator.api_key=null"]).coordinator.api_key is None
    for empty in ("coordinator.api_key=", "coordinator.api_key= "):  # not "no key": refused, naming the key
        with pytest.raises(ConfigError, match="coordinator.api_key=: an empty value"):
            load_config(path, [empty])
    with pytest.raises(ConfigError, match="empty api_key would accept any client"):
        load_config(path, ["coordinator.api_key=''"])
    # The value is read as YAML: a flow list of stages replaces the whole list.
    cfg = load_config(path, ["stages=[{layers: [0, 4], endpoint: 'tcp://h:6000'}]", "box.curve_dir=/k"])
    assert [s.endpoint for s in cfg.stages] == ["tcp://h:6000"]
    with pytest.raises(ConfigError, match="across a network in clear; set box.curve_dir"):  # and without CURVE
        load_config(path, ["stages=[{layers: [0, 4], endpoint: 'tcp://h:6000'}]"])


def test_overrides_reach_default_stages() -> None:
    cfg = config_from_dict({}, ["stages.1.device=cuda:1"])
    assert [s.device for s in cfg.stages] == ["cpu", "cuda:1"]
    assert cfg.stages[1].endpoint == Config().stages[1].endpoint


def test_override_values_are_validated() -> None:
    err = _refused({}, ["engine.kv_pool_tokens=lots"])
    assert err.key == "engine.kv_pool_tokens" and "(got 'lots')" in str(err)
    err = _refused({}, ["engine.kv_pool_tokens=100", "engine.max_context=8192", "engine.chunk_cells=64"])
    assert err.key == "engine.kv_pool_tokens"


@pytest.mark.parametrize(
    "override, words",
    [
        ("engine.kv_pool_tokens", "expected key=value"),
        ("=5", "expected key=value"),
        ("engine..parallel=2", "empty part"),
        ("stages.2.device=cpu", "stages has 2 entries, no index '2'"),
        ("stages.first.device=cpu", "no index 'first'"),
        ("engine.parallel.max=2", "engine.parallel is a value (4), not a section"),
    ],
)
def test_bad_overrides(override: str, words: str) -> None:
    data = {"engine": {"parallel": 4}, "stages": _stages((0, 2), (2, 4))}
    assert words in str(_refused(data, [override]))


def test_apply_overrides_does_not_touch_the_caller_dict_through_config_from_dict() -> None:
    data = {"engine": {"parallel": 4}}
    config_from_dict(data, ["engine.parallel=2", "engine.max_waiting=3"])
    assert data == {"engine": {"parallel": 4}}
    assert apply_overrides({"a": [1, {"b": 2}]}, ["a.1.b=3", "a.0=x"]) == {"a": ["x", {"b": 3}]}


# --- YAML errors -------------------------------------------------------------------------------------------

def test_yaml_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  parallel: 4\n   max_context: 10\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3:15: not valid YAML: mapping values are not allowed here$"):
        load_config(bad)
    dup = tmp_path / "dup.yaml"
    dup.write_text("engine:\n  parallel: 4\n  max_context: 4096\n  parallel: 8\n")
    with pytest.raises(ConfigError, match=r"dup.yaml:4:3: not valid YAML: duplicate key 'parallel' \(first on line 2\)$"):
        load_config(dup)
    top = tmp_path / "list.yaml"
    top.write_text("- model: tiny\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(top)
    with pytest.raises(ConfigError, match="missing.yaml: config file not found"):
        load_config(tmp_path / "missing.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    assert load_config(empty) == Config()
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("enigne:\n  parallel: 2\n")
    with pytest.raises(ConfigError, match=r"enigne: unknown key \(did you mean engine\?\)"):
        load_config(unknown)


# --- fingerprint -------------------------------------------------------------------------------------------

def test_fingerprint_stable(tmp_path: Path) -> None:
    a = load_config(default_config_path())
    # Same content, other key order and spelling (flow vs block YAML, int device vs "cpu" strings).
    text = ("stages:\n  - endpoint: ipc://{runtime}/stage-0\n    layers: [0, 2]\n    device: cpu\n"
            "  - {endpoint: 'ipc://{runtime}/stage-1', layers: [2, 4]}\n"
            "engine: {chunk_cells: 256, kv_pool_tokens: 16384, parallel: 4, max_context: 4096}\nmodel: tiny\n")
    (tmp_path / "same.yaml").write_text(text)
    assert load_config(tmp_path / "same.yaml").fingerprint() == a.fingerprint()
    assert load_config(default_config_path(), ["engine.parallel=4"]).fingerprint() == a.fingerprint()
    assert len(a.fingerprint()) == 16 and int(a.fingerprint(), 16) >= 0
    # Another process, another hash seed: the same fingerprint.
    code = "from pool.config import load_config, default_config_path; print(load_config(default_config_path()).fingerprint())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert out == a.fingerprint()


@pytest.mark.parametrize(
    "override",
    ["engine.kv_pool_tokens=32768", "engine.chunk_cells=128", "engine.max_context=2048", "engine.parallel=3",
     "engine.kv_dtype=int8", "engine.dtype=bfloat16", "model=/srv/models/other", "stages.1.device=cuda:0",
     "stages.0.layers=[0,1]", "stages.1.endpoint=ipc:///tmp/elsewhere", "stages.1.data_endpoint=ipc:///tmp/d"],
)
def test_fingerprint_sensitive(override: str) -> None:
    base = load_config(default_config_path())
    extra = ["stages.1.layers=[1,4]"] if override.startswith("stages.0.layers") else []
    assert load_config(default_config_path(), [override, *extra]).fingerprint() != base.fingerprint()


@pytest.mark.parametrize("override", ["coordinator.port=9000", "coordinator.api_key=k", "coordinator.host=0.0.0.0"])
def test_fingerprint_ignores_the_http_front(override: str) -> None:
    base = load_config(default_config_path())
    assert load_config(default_config_path(), [override]).fingerprint() == base.fingerprint()


# --- layer chains, as a property ---------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=5), st.data())
def test_any_contiguous_split_is_accepted_and_any_broken_one_refused(sizes: list[int], data: st.DataObject) -> None:
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    ranges = list(zip(bounds, bounds[1:]))
    cfg = config_from_dict({"stages": _stages(*ranges)})
    cfg.check_layers(bounds[-1])
    if len(ranges) < 2:
        return
    i = data.draw(st.integers(1, len(ranges) - 1))
    shift = data.draw(st.sampled_from([-1, 1]))
    broken = list(ranges)
    broken[i] = (broken[i][0] + shift, broken[i][1])
    if broken[i][0] >= broken[i][1]:
        return
    err = _refused({"stages": _stages(*broken)})
    assert err.key in (f"stages.{i}.layers", f"stages.{i - 1}.layers")
