"""Torch threads per stage: engine.threads when set, else all the machine's cores for stages that take turns,
and the cores shared by the CPU stages of a machine for pipelined ones (pool/pipeline.py rule 3)."""
from __future__ import annotations

import pytest

import stages.runner as runner
from pool.config import load_config


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(runner, "_cores", lambda: 8)


def test_two_cpu_stages_on_one_machine_take_turns_with_all_the_cores(eight_cores):
    cfg = load_config(None)  # the embedded default: two CPU stages over ipc://
    assert [runner.stage_threads(cfg, i) for i in (0, 1)] == [8, 8]


def test_two_pipelined_cpu_stages_on_one_machine_get_half_the_cores_each(eight_cores):
    cfg = load_config(None, ["engine.pipeline=true"])
    assert [runner.stage_threads(cfg, i) for i in (0, 1)] == [4, 4]


def test_engine_threads_wins(eight_cores):
    cfg = load_config(None, ["engine.threads=3"])
    assert [runner.stage_threads(cfg, i) for i in (0, 1)] == [3, 3]


def test_only_the_cpu_stages_of_the_same_machine_share(eight_cores):
    cfg = load_config(None, ["stages.1.device=cuda:0"])
    assert [runner.stage_threads(cfg, i) for i in (0, 1)] == [8, 0]
    cfg = load_config(None, ["stages.0.endpoint=tcp://10.0.0.5:7000", "stages.1.endpoint=tcp://127.0.0.1:7000",
                                 "box.curve_dir=/etc/strata/keys"])
    assert [runner.stage_threads(cfg, i) for i in (0, 1)] == [8, 8]
    cfg = load_config(None, ["stages.0.endpoint=tcp://localhost:7000", "stages.1.endpoint=ipc:///tmp/s1",
                             "engine.pipeline=true"])
    assert [runner.stage_threads(cfg, i) for i in (0, 1)] == [4, 4]


def test_at_least_one_thread(monkeypatch):
    monkeypatch.setattr(runner, "_cores", lambda: 1)
    assert [runner.stage_threads(load_config(None), i) for i in (0, 1)] == [1, 1]
