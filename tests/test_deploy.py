"""deploy/systemd: the units say what DEPLOY.md says, and systemd itself accepts them where it is installed."""
from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from pool.config import load_config

REPO = Path(__file__).resolve().parents[1]
UNITS = REPO / "deploy" / "systemd"
ENV_FILE = "/etc/strata/strata.env"


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections -> (key, value) in order; repeated keys kept (systemd appends list settings)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith(("#", ";")):
            continue
        if text.startswith("[") and text.endswith("]"):
            current = sections.setdefault(text[1:-1], [])
            continue
        assert current is not None, f"{path.name}:{number}: a setting before any section"
        assert "=" in text and not text.endswith("\\"), f"{path.name}:{number}: not key=value: {line!r}"
        key, value = text.split("=", 1)
        current.append((key.strip(), value.strip()))
    return sections


def one(unit: dict, section: str, key: str) -> str:
    values = [v for k, v in unit[section] if k == key]
    assert len(values) == 1, f"[{section}] {key}: {values}"
    return values[0]


def words(unit: dict, section: str, key: str) -> list[str]:
    return [w for k, v in unit[section] if k == key for w in v.split()]


@pytest.fixture(scope="module")
def coord() -> dict:
    return parse_unit(UNITS / "strata-coord.service")


@pytest.fixture(scope="module")
def stage() -> dict:
    return parse_unit(UNITS / "strata-stage@.service")


def test_both_services_share_user_env_and_restart(coord: dict, stage: dict) -> None:
    for unit in (coord, stage):
        assert one(unit, "Service", "User") == "strata" and one(unit, "Service", "Group") == "strata"
        assert one(unit, "Service", "EnvironmentFile") == ENV_FILE
        assert one(unit, "Service", "Restart") == "on-failure"
        assert one(unit, "Service", "RestartPreventExitStatus") == "2"  # a refused config: restarting cannot help
        assert int(one(unit, "Unit", "StartLimitBurst")) >= 1 and one(unit, "Unit", "StartLimitIntervalSec")
        assert one(unit, "Install", "WantedBy") == "strata.target"
        assert one(unit, "Unit", "PartOf") == "strata.target"
        # Separate /tmp or /dev per unit would hide the ipc sockets, the pool files and the GPUs.
        assert not {k for k, _ in unit["Service"]} & {"PrivateTmp", "PrivateDevices", "PrivateIPC"}
        assert one(unit, "Service", "RuntimeDirectory") == "strata"


def test_exec_start(coord: dict, stage: dict) -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for unit, name, args in ((coord, "strata-coord", "--config ${STRATA_CONFIG}"),
                             (stage, "strata-stage", "--device %i --config ${STRATA_CONFIG}")):
        exe, _, rest = one(unit, "Service", "ExecStart").partition(" ")
        assert exe.startswith("/") and Path(exe).name == name and name in scripts
        assert rest == args


def test_memlock_for_pinned_pool(stage: dict, coord: dict) -> None:
    assert one(stage, "Service", "LimitMEMLOCK") == "infinity"
    assert "LimitMEMLOCK" not in {k for k, _ in coord["Service"]}  # the coordinator holds no K/V


def test_coordinator_ordered_after_the_stages(coord: dict) -> None:
    for key in ("After", "Wants"):
        assert {"strata-stage@0.service", "strata-stage@1.service"} <= set(words(coord, "Unit", key))
    assert "Requires" not in {k for k, _ in coord["Unit"]}  # a restarting stage must not stop the coordinator
    # As many stages as the dual-3080 box has.
    wanted = [w for w in words(coord, "Unit", "Wants") if w.startswith("strata-stage@")]
    assert len(wanted) == len(load_config(REPO / "configs" / "dual-3080.yaml").stages)


def test_target_groups_the_units() -> None:
    target = parse_unit(UNITS / "strata.target")
    assert set(words(target, "Unit", "Wants")) == {"strata-coord.service", "strata-stage@0.service",
                                                   "strata-stage@1.service"}
    assert one(target, "Install", "WantedBy") == "multi-user.target"


def test_env_file_names_the_config_once() -> None:
    pairs = [line.split("=", 1) for line in (UNITS / "strata.env").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    env = dict(pairs)
    assert len(env) == len(pairs) and all(k.isidentifier() and k.isupper() for k in env)
    assert env["STRATA_CONFIG"].startswith("/etc/strata/") and env["STRATA_CONFIG"].endswith(".yaml")
    assert env["STRATA_LOG_LEVEL"] in ("debug", "info", "warning", "error")


def test_dual_3080_endpoints_live_in_the_runtime_directory() -> None:
    cfg = load_config(REPO / "configs" / "dual-3080.yaml")
    assert all(s.endpoint.startswith("ipc:///run/strata/") for s in cfg.stages)


def _systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed")
    return exe


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    exe = _systemd_analyze()
    # A trivially valid unit first: where verify cannot run at all (no systemd in a container), skip.
    probe = tmp_path / "probe" / "strata-probe.service"
    probe.parent.mkdir()
    probe.write_text("[Service]\nType=oneshot\nExecStart=/bin/true\n")
    if subprocess.run([exe, "verify", "--man=no", str(probe)], capture_output=True, text=True).returncode != 0:
        pytest.skip("systemd-analyze verify does not work here")
    # The units as shipped, but with the venv's scripts replaced by stubs that exist (verify checks them).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("strata-coord", "strata-stage"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    for f in UNITS.iterdir():
        if f.suffix in (".service", ".target"):
            text = f.read_text()
            assert "/opt/strata/venv/bin/" in text or f.suffix == ".target"
            (units / f.name).write_text(text.replace("/opt/strata/venv/bin/", f"{bin_dir}/"))
    names = ["strata-coord.service", "strata-stage@0.service", "strata-stage@1.service", "strata.target"]
    run = subprocess.run([exe, "verify", "--man=no", *(str(units / n) for n in names)], cwd=units,
                         capture_output=True, text=True)
    assert run.returncode == 0 and run.stderr.strip() == "", run.stderr
    # And it does catch a broken unit.
    (units / "strata-coord.service").write_text(
        (units / "strata-coord.service").read_text().replace("Restart=on-failure", "Restart=sometimes"))
    run = subprocess.run([exe, "verify", "--man=no", str(units / "strata-coord.service")], cwd=units,
                         capture_output=True, text=True)
    assert "strata-coord.service:" in run.stderr and "restart" in run.stderr.lower()


def test_docs_cover_the_operator_steps() -> None:
    deploy = (REPO / "docs" / "DEPLOY.md").read_text()
    for needle in ("useradd", "/etc/strata/strata.env", "systemctl enable --now strata.target",
                   "journalctl -u strata-coord", "LimitMEMLOCK", "strata config check", "pip install"):
        assert needle in deploy, needle
