"""pool/logs.py: one logfmt line per event, values quoted when needed, parseable back."""
from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pool.logs import event, format_value, setup_logging

REPO = Path(__file__).resolve().parents[2]
TS = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def _unescape(m: re.Match) -> str:
    c = m.group(1)
    if len(c) == 3 and c.startswith("x"):
        return chr(int(c[1:], 16))
    return {"n": "\n", "r": "\r", "t": "\t"}.get(c, c)


def parse_logfmt(line: str) -> list[tuple[str, str]]:
    """A small independent logfmt reader: key=value or key="escaped value", space separated."""
    pairs, i = [], 0
    token = re.compile(r'([^\s=]+)=("(?:[^"\\]|\\.)*"|[^\s"]*)')
    while i < len(line):
        m = token.match(line, i)
        assert m, f"not logfmt at {i}: {line[i:]!r}"
        key, raw = m.group(1), m.group(2)
        if raw.startswith('"'):
            raw = re.sub(r"\\(x[0-9a-f]{2}|.)", _unescape, raw[1:-1])
        pairs.append((key, raw))
        i = m.end()
        if i < len(line):
            assert line[i] == " ", line
            i += 1
    return pairs


@pytest.fixture
def captured() -> io.StringIO:
    out = io.StringIO()
    setup_logging("coord", "debug", stream=out)
    yield out
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_strata_logfmt", False):
            root.removeHandler(h)


def test_event_line(captured: io.StringIO) -> None:
    event(logging.getLogger("strata.coord"), "request.done", request="abc", slot=2, cells=4096, truncated=False,
          reason=None, seconds=0.25)
    line = captured.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1
    assert re.fullmatch(
        rf"ts={TS} level=info component=coord event=request.done request=abc slot=2 cells=4096 truncated=false "
        r"reason=null seconds=0.25\n", line), line


@pytest.mark.parametrize(
    "value, text",
    [
        ("plain", "plain"),
        ("", '""'),
        ("two words", '"two words"'),
        ("a=b", '"a=b"'),
        ('say "hi"', r'"say \"hi\""'),
        ("back\\slash", r'"back\\slash"'),
        ("line\nbreak\ttab\rcr", r'"line\nbreak\ttab\rcr"'),
        ("bell\x07", r'"bell\x07"'),
        ("ünïcode", "ünïcode"),
        (7, "7"),
        (-1.5, "-1.5"),
        (True, "true"),
        (None, "null"),
        ([1, 2], "[1,2]"),
        ({"a": "b c"}, r'"{\"a\":\"b c\"}"'),
        (Path("/tmp/x"), "/tmp/x"),
    ],
)
def test_values(value: object, text: str) -> None:
    assert format_value(value) == text


def test_round_trip_through_a_parser(captured: io.StringIO) -> None:
    nasty = 'a "quoted" = value\nwith\\ newline\tand\x01ctl'
    event(logging.getLogger("strata.x"), "odd.values", text=nasty, empty="", url="http://127.0.0.1:8080/v1?a=b")
    pairs = dict(parse_logfmt(captured.getvalue().rstrip("\n")))
    assert pairs["text"] == nasty and pairs["empty"] == "" and pairs["url"] == "http://127.0.0.1:8080/v1?a=b"
    assert pairs["event"] == "odd.values" and pairs["component"] == "coord"


def test_reserved_and_odd_keys_are_renamed(captured: io.StringIO) -> None:
    event(logging.getLogger("strata.x"), "e", ts=1, component="other", **{"bad key": 2})
    keys = [k for k, _ in parse_logfmt(captured.getvalue().rstrip("\n"))]
    assert keys == ["ts", "level", "component", "event", "ts_", "component_", "bad_key"]


def test_plain_records_and_exceptions_stay_on_one_line(captured: io.StringIO) -> None:
    log = logging.getLogger("uvicorn.error")
    log.warning("port %d busy", 8080)
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        log.exception("failed")
    lines = captured.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (dict(parse_logfmt(x)) for x in lines)
    assert (first["level"], first["logger"], first["msg"]) == ("warning", "uvicorn.error", "port 8080 busy")
    assert second["level"] == "error" and "RuntimeError: boom\nsecond line" in second["exc"]


def test_levels(captured: io.StringIO) -> None:
    log = logging.getLogger("strata.y")
    setup_logging("stage1", "warning", stream=captured)
    event(log, "quiet")
    event(log, "loud", level="error", n=1)
    assert captured.getvalue().count("\n") == 1 and "level=error component=stage1 event=loud n=1" in captured.getvalue()
    with pytest.raises(ValueError, match="log level 'chatty'"):
        setup_logging("x", "chatty", stream=captured)


def test_setup_replaces_only_its_own_handler(captured: io.StringIO) -> None:
    other = logging.NullHandler()
    logging.getLogger().addHandler(other)
    try:
        setup_logging("coord", "info", stream=captured)
        setup_logging("coord", "info", stream=captured)
        ours = [h for h in logging.getLogger().handlers if getattr(h, "_strata_logfmt", False)]
        assert len(ours) == 1 and other in logging.getLogger().handlers
    finally:
        logging.getLogger().removeHandler(other)


def test_stderr_and_env_level_in_a_fresh_process() -> None:
    code = ("import logging; from pool.logs import setup_logging, event; setup_logging('coord'); "
            "event(logging.getLogger('strata'), 'hidden.debug'); event(logging.getLogger('strata'), 'shown', level='warning')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"STRATA_LOG_LEVEL": "warning", "PATH": "/usr/bin:/bin"})
    assert out.stdout == ""
    assert re.fullmatch(rf"ts={TS} level=warning component=coord event=shown\n", out.stderr), out.stderr
