"""Structured logs: one logfmt line per event on stderr, for journald and grep (no torch, stdlib only).

    ts=2025-06-01T12:00:00.123Z level=info component=coord event=request.done request=abc slot=2 cells=4096

Rules:
- `event(logger, name, **fields)` is the way to log something a program or an operator acts on; the name
  is dotted, noun first (`request.done`, `pool.evict`, `stage.down`). Plain `logger.info("text")` records
  (and those of libraries) come out as `logger=<name> msg="text"`.
- Keys come first in a fixed order: ts (UTC, milliseconds), level, component, then event or logger/msg,
  then the fields in the order given. A field named like one of the fixed keys gets a trailing `_`.
- Values: None -> null, bools -> true/false, numbers as Python writes them, lists and dicts as compact
  JSON, anything else as str(). A value is quoted ("...", with \\ \" \n \r \t escaped) when it is empty
  or holds a space, `=`, a quote, a backslash or a control character; so one event is always one line,
  exceptions included (`exc="Traceback ...\n..."`).
- Stderr, not a file: under systemd the journal adds the unit, pid and its own timestamp; `strata up`
  lets the children inherit its stderr.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

_FIXED = ("ts", "level", "component", "event", "logger", "msg", "exc")
_EVENT_ATTR = "strata_event"
_FIELDS_ATTR = "strata_fields"
_HANDLER_MARK = "_strata_logfmt"


def format_value(value: Any) -> str:
    """One logfmt value (see the module rules)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        text = repr(value)
    elif isinstance(value, (list, tuple, dict)):
        text = json.dumps(value, separators=(",", ":"), default=str)
    else:
        text = str(value)
    if text and not any(c in ' ="\\' or ord(c) < 32 or ord(c) == 127 for c in text):
        return text
    escaped = (text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
               .replace("\t", "\\t"))
    escaped = "".join(c if ord(c) >= 32 and ord(c) != 127 else f"\\x{ord(c):02x}" for c in escaped)
    return f'"{escaped}"'


def _key(name: str) -> str:
    key = "".join(c if c.isalnum() or c in "._-" else "_" for c in str(name)) or "_"
    return key + "_" if key in _FIXED else key


def format_pairs(pairs: list[tuple[str, Any]]) -> str:
    return " ".join(f"{k}={format_value(v)}" for k, v in pairs)


class LogfmtFormatter(logging.Formatter):
    """Formats every record as one logfmt line for `component`."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        pairs: list[tuple[str, Any]] = [
            ("ts", f"{ts}.{int(record.msecs):03d}Z"),
            ("level", record.levelname.lower()),
            ("component", self.component),
        ]
        name = getattr(record, _EVENT_ATTR, None)
        if name is not None:
            pairs.append(("event", name))
            pairs.extend((_key(k), v) for k, v in getattr(record, _FIELDS_ATTR, {}).items())
        else:
            pairs += [("logger", record.name), ("msg", record.getMessage())]
        if record.exc_info:
            pairs.append(("exc", self.formatException(record.exc_info)))
        if record.stack_info:
            pairs.append(("stack", self.formatStack(record.stack_info)))
        return format_pairs(pairs)


def _level(level: str | int | None) -> int:
    if level is None:
        level = os.environ.get("STRATA_LOG_LEVEL", "info")
    if isinstance(level, int):
        return level
    value = logging.getLevelName(str(level).upper())
    if not isinstance(value, int):
        raise ValueError(f"log level {level!r}: use debug, info, warning, error or critical")
    return value


def setup_logging(component: str, level: str | int | None = None, stream: TextIO | None = None) -> logging.Logger:
    """Send every record of this process to `stream` (default stderr) as logfmt lines tagged `component`.

    `level` defaults to $STRATA_LOG_LEVEL, else info. Calling it again replaces the handler it installed
    (not others), so a process can rename its component once it knows it (e.g. `stage1`). Returns the
    `strata` logger.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    handler.setFormatter(LogfmtFormatter(component))
    root.addHandler(handler)
    root.setLevel(_level(level))
    # uvicorn installs its own handlers and stops propagation; its records go through ours instead.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    logging.captureWarnings(True)
    return logging.getLogger("strata")


def event(logger: logging.Logger, name: str, level: str | int = logging.INFO, **fields: Any) -> None:
    """Log event `name` with `fields` (in order) at `level` (default info); one line, see the module rules."""
    lvl = _level(level)
    if not logger.isEnabledFor(lvl):
        return
    logger.log(lvl, "%s %s", name, format_pairs([(_key(k), v) for k, v in fields.items()]),
               extra={_EVENT_ATTR: name, _FIELDS_ATTR: fields}, stacklevel=2)
