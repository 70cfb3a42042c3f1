"""pool/pipeline.py: which boxes take turns and which pipeline, and how many groups the scheduler keeps."""
from __future__ import annotations

from pathlib import Path

import pytest

from pool import pipeline
from pool.config import load_config


def test_cpu_stages_of_one_machine_take_turns_by_default():
    cfg = load_config(None)  # the embedded default: two CPU stages over ipc://
    assert pipeline.turns(cfg) and pipeline.groups(cfg) == 1
    assert [pipeline.sharing(cfg, i) for i in (0, 1)] == [1, 1]
    local_tcp = load_config(None, ["stages.0.endpoint=tcp://127.0.0.1:7000", "stages.1.endpoint=ipc:///tmp/s1"])
    assert pipeline.turns(local_tcp)


@pytest.mark.parametrize("sets", [
    ["stages.1.device=cuda:0"],  # a GPU stage computes on its own
    ["stages.0.endpoint=tcp://10.0.0.5:7000", "stages.1.endpoint=tcp://127.0.0.1:7000",
     "box.curve_dir=/etc/strata/keys"],  # two machines
    ["engine.pipeline=true"],
], ids=["gpu-stage", "two-machines", "pipeline-true"])
def test_stages_with_compute_of_their_own_are_pipelined(sets):
    cfg = load_config(None, sets)
    assert not pipeline.turns(cfg) and pipeline.groups(cfg) == 2


def test_pipeline_false_takes_turns_anywhere_and_one_stage_is_either():
    cfg = load_config(None, ["stages.0.device=cuda:0", "stages.1.device=cuda:1", "engine.pipeline=false"])
    assert pipeline.turns(cfg) and pipeline.groups(cfg) == 1
    piped = load_config(None, ["engine.pipeline=true"])
    assert [pipeline.sharing(piped, i) for i in (0, 1)] == [2, 2]
    one = load_config(None, ["stages=[{device: cpu, layers: [0, 4], endpoint: 'ipc:///tmp/s0'}]",
                             "engine.pipeline=false"])
    assert not pipeline.turns(one) and pipeline.groups(one) == 1


def test_a_pipeline_value_that_is_neither_is_refused():
    from pool.config import ConfigError

    with pytest.raises(ConfigError, match="engine.pipeline"):
        load_config(None, ["engine.pipeline=sometimes"])


def test_cpu_stages_in_turns_spin_briefly_unless_the_environment_says_otherwise():
    """Rule 5: libgomp's default spin after a step would hold the cores the next stage in turn needs."""
    cfg = load_config(None)
    assert pipeline.spin_env(cfg, 0, {}) == {"GOMP_SPINCOUNT": pipeline.SPIN_TURNS}
    assert pipeline.spin_env(cfg, 1, {"PATH": "/bin"}) == {"GOMP_SPINCOUNT": pipeline.SPIN_TURNS}
    assert pipeline.spin_env(cfg, 0, {"OMP_WAIT_POLICY": "PASSIVE"}) == {}
    assert pipeline.spin_env(cfg, 0, {"GOMP_SPINCOUNT": "300000"}) == {}
    assert pipeline.spin_env(load_config(None, ["engine.pipeline=true"]), 0, {}) == {}  # own cores: as shipped
    gpu = load_config(None, ["stages.0.device=cuda:0", "stages.1.device=cuda:1", "engine.pipeline=false"])
    assert pipeline.spin_env(gpu, 0, {}) == {}


def test_a_stage_process_in_turns_starts_with_the_short_spin(tmp_path):
    """stages/server.py applies rule 5 before torch loads OpenMP: `--prepare` exits right after that point."""
    import os
    import subprocess
    import sys

    cfg = tmp_path / "box.yaml"
    cfg.write_text("model: tiny\n")
    probe = ("import os, sys; import stages.server as s; s.main(['--device', '0', '--config', sys.argv[1], "
             "'--prepare']); print('SPIN', os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", probe, str(cfg)], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"SPIN {pipeline.SPIN_TURNS}" in out.stdout
