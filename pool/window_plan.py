"""How big a stage's device window is: `engine.device_cells` against the device's memory (no torch here).

A frame holds one pool chunk's cells in every local attention layer of the stage (stages/window.py), so

    frame_bytes  = chunk_cells * bytes_per_cell * n_layers           (PoolLayout: K, V and int8 scales)
    window_bytes = (frames + 1) * frame_bytes                         (+ 1: the trash frame)

Rules (`plan_frames`):
- CPU stage: the window is off unless `device_cells` is a number of cells > 0 ("auto" and 0 are off). With it,
  the frames are a separate array in host memory, so the whole mechanism runs where CI runs.
- CUDA stage: the host pool is the pinned pool file and the frames are in device memory; a CUDA stage always
  has a window. "auto" is the whole pool (`n_chunks` frames) when it fits the device's free memory after the
  weights and the scratch estimate, otherwise the largest window that fits. A number of cells is rounded up to
  whole chunks, capped at the pool; one that does not fit is refused with the figures. So is "auto" when not
  even one frame fits, and 0.
- `scratch_bytes` is the device memory kept free for a step's transient tensors (an estimate, stated in the
  formula): activations of a `prefill_chunk` step in float32, one layer's context gathered and dequantised
  (K and V of `max_context` cells in float32), the scores of one streamed piece (`PIECE_SCORE_BYTES`), the
  sampled rows' logits, and `SLACK_BYTES` for the allocator's rounding and the kernels' workspaces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pool.config import ConfigError, EngineConfig

GIB = 1 << 30
PIECE_SCORE_BYTES = 256 << 20  # scores of one streamed piece (stages/window.py caps a piece to this)
SLACK_BYTES = 512 << 20


@dataclass(frozen=True)
class Geometry:
    """What the scratch estimate needs of the model."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    is_last: bool


def frame_bytes(chunk_cells: int, bytes_per_cell: int, n_layers: int) -> int:
    """One frame: one chunk's cells in every local layer."""
    return chunk_cells * bytes_per_cell * n_layers


def window_bytes(frames: int, frame_nbytes: int) -> int:
    """The frames plus the trash frame."""
    return (frames + 1) * frame_nbytes if frames else 0


def scratch_bytes(e: EngineConfig, g: Geometry) -> int:
    """Device memory kept free for one step's transient tensors (module docstring)."""
    act = e.prefill_chunk * (4 * g.hidden + 2 * g.intermediate + (g.heads + 2 * g.kv_heads) * g.head_dim) * 4
    gather = 2 * e.max_context * g.kv_heads * g.head_dim * 4
    logits = e.parallel * g.vocab * 4 if g.is_last else 0
    return act + gather + PIECE_SCORE_BYTES + logits + SLACK_BYTES


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def plan_frames(e: EngineConfig, device: str, frame_nbytes: int, stage: int, free_bytes: int | None = None,
                weight_bytes: int | None = None, scratch: int = 0) -> int:
    """Frames of stage `stage`'s window on `device` (rules in the module docstring); ConfigError when it cannot
    have the window asked for. `free_bytes`: the device's free memory now (CUDA; None: not known, e.g. in
    `strata config check`, where "auto" then means the whole pool)."""
    cells = e.device_cells
    key = "engine.device_cells"
    if device == "cpu":
        return 0 if cells in ("auto", 0) else min(e.n_chunks, math.ceil(cells / e.chunk_cells))
    if cells == 0:
        raise ConfigError(f"{key}=0: stage {stage} on {device} needs a device window (its K/V stay in the pinned "
                          f"host pool, steps read them through frames); use auto or a number of cells", key=key)
    want = e.n_chunks if cells == "auto" else min(e.n_chunks, math.ceil(cells / e.chunk_cells))
    if free_bytes is None:
        return want
    room = free_bytes - scratch
    fit = max(0, room // frame_nbytes - 1)  # - 1: the trash frame
    figures = (f"{_gib(free_bytes)} free on {device}" + (f" after the weights ({_gib(weight_bytes)})" if weight_bytes
               is not None else "") + f", {_gib(scratch)} kept for scratch, {frame_nbytes} B per frame of "
               f"{e.chunk_cells} cells")
    if fit < 1:
        raise ConfigError(f"{key}: stage {stage} has no room for a device window: {figures}", key=key)
    if cells == "auto":
        return min(want, fit)
    if want > fit:
        raise ConfigError(f"{key}={cells}: stage {stage} needs {_gib(window_bytes(want, frame_nbytes))} for "
                          f"{want} frames but {figures}; the largest window that fits is {fit * e.chunk_cells} cells",
                          key=key)
    return want
