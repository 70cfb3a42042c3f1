"""Benchmark results: the small statistics they need, and how they are written (table, JSON, PNG).

A result is one plain dict, the same for every subcommand, so that the JSON is the record and the table and the
plot are views of it::

    {"bench": "pool",                       # the subcommand; files are <out>/<bench>.json and .png
     "machine": {...},                      # where it ran (machine_info()): figures are only comparable there
     "columns": ["geometry", "cells", ...], # the table's columns, in order
     "rows": [{"geometry": "tiny", "cells": 16384, ...}, ...],
     "plot": {"x": "cells", "series": ["geometry", "kv_dtype"], "logx": true,
              "panels": [{"y": ["swap_us", "copy_us"], "ylabel": "move time (us)", "logy": true}]},
     "tables": [{"title": ..., "columns": [...], "rows": [...]}],   # optional further tables
     "notes": ["..."]}                      # how each figure was taken, and what was scaled or skipped

Every figure in a row is measured in the run that wrote it; ratios are taken between figures of the same run
(`ratio`), never against a number from elsewhere.
"""
from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 <= q <= 100) with linear interpolation between closest ranks (numpy's default
    "linear" method), so p50 of an even count is the mean of the two middle values. None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    data = sorted(float(v) for v in values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is not positive: a ratio
    against nothing is reported as absent, not as infinity."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def machine_info() -> dict[str, Any]:
    """What the figures depend on: CPU count, platform, Python. Torch threads are recorded by the runs that
    set them."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }


def format_value(value: Any) -> str:
    """Numbers with about four significant digits; None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value == 0 or math.isnan(value) or math.isinf(value):
            return str(value)
        mag = abs(value)
        if mag >= 1000:
            return f"{value:,.0f}"
        if mag >= 1:
            return f"{value:.4g}"
        return f"{value:.3g}"
    return str(value)


def format_table(columns: Sequence[str], rows: Iterable[dict[str, Any]]) -> str:
    """A plain-text table: a header line, a rule, one line per row; numbers right-aligned."""
    rows = list(rows)
    cells = [[format_value(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [bool(rows) and all(isinstance(row.get(c), (int, float)) or row.get(c) is None for row in rows)
               for c in columns]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(list(columns)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _series_key(row: dict[str, Any], fields: Sequence[str]) -> str:
    return " ".join(str(row.get(f)) for f in fields) if fields else ""


def _bars(ax: Any, rows: list[dict[str, Any]], groups: dict[str, list[dict[str, Any]]], x_field: str,
          y_fields: Sequence[str], series: Sequence[str]) -> None:
    """Grouped bars: one group per x value (in row order), one bar per (series value, y column) inside it."""
    cats = list(dict.fromkeys(str(r[x_field]) for r in rows))
    bars = [(name, y) for name in groups for y in y_fields]
    width = 0.8 / max(1, len(bars))
    for k, (name, y_field) in enumerate(bars):
        by_cat = {str(r[x_field]): r.get(y_field) for r in groups[name]}
        xs = [i + (k - (len(bars) - 1) / 2) * width for i, c in enumerate(cats) if by_cat.get(c) is not None]
        ys = [by_cat[c] for c in cats if by_cat.get(c) is not None]
        label = " ".join(f"{f}={v}" for f, v in zip(series, name.split(" "))) if series else y_field
        ax.bar(xs, ys, width=width, label=label if len(y_fields) == 1 else f"{label} {y_field}")
    ax.set_xticks(range(len(cats)), cats, rotation=15)


def write_plot(result: dict[str, Any], path: Path) -> Path | None:
    """Draw result["plot"] to `path` (PNG, matplotlib's Agg backend, no display needed). One panel per entry of
    plot["panels"]; in each, one line per (series value, y column), or grouped bars for a panel of kind "bar".
    None when the result has no plot."""
    spec = result.get("plot")
    rows = result.get("rows") or []
    if not spec or not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = spec["panels"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    x_field, series = spec["x"], spec.get("series", [])
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(_series_key(row, series), []).append(row)
    for ax, panel in zip(axes[0], panels):
        if panel.get("kind") == "bar":
            _bars(ax, rows, groups, x_field, panel["y"], series)
        else:
            for name, group in groups.items():
                for y_field in panel["y"]:
                    pts = sorted((r[x_field], r[y_field]) for r in group
                                 if r.get(y_field) is not None and r.get(x_field) is not None)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                label=f"{name} {y_field}".strip())
        if spec.get("logx") and panel.get("kind") != "bar":
            ax.set_xscale("log", base=2)
        if panel.get("logy"):
            ax.set_yscale("log")
        ax.set_xlabel(spec.get("xlabel", x_field))
        ax.set_ylabel(panel.get("ylabel", ""))
        if panel.get("title"):
            ax.set_title(panel["title"], fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(spec.get("title", f"strata bench {result.get('bench', '')}"), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(result: dict[str, Any], out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
    """Write <out>/<bench>.json (the whole result) and <out>/<bench>.png (its plot); return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = result["bench"]
    paths = {"json": out / f"{name}.json"}
    paths["json"].write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    if plot:
        try:
            png = write_plot(result, out / f"{name}.png")
        except ImportError:  # matplotlib comes with the `bench` extra; the table and JSON do not need it
            print("no PNG: matplotlib is not installed (pip install -e '.[bench]')")
            png = None
        if png is not None:
            paths["png"] = png
    return paths


def render(result: dict[str, Any]) -> str:
    """The table and the notes, as printed on stdout."""
    parts = [f"strata bench {result['bench']}"]
    parts.append(format_table(result["columns"], result["rows"]))
    for table in result.get("tables", []):
        parts.append("")
        parts.append(table.get("title", ""))
        parts.append(format_table(table["columns"], table["rows"]))
    for note in result.get("notes", []):
        parts.append(f"note: {note}")
    return "\n".join(parts)
