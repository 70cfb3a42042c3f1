"""What the link checks and raises: the stages' HELLOs must fit together, and the errors steps fail with."""
from __future__ import annotations

GEOMETRY = ("n_chunks", "chunk_cells", "table_chunks")


class LinkError(RuntimeError):
    """The stages cannot be served together; the message names the mismatch."""


class StageDown(RuntimeError):
    """A stage stopped answering; every step in flight when it happened fails with this."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"stage {index} is down: {reason}")
        self.index = index
        self.reason = reason


class StepFailed(RuntimeError):
    """A stage refused or failed one step (it keeps serving)."""

    def __init__(self, step: int, stage: int, message: str) -> None:
        super().__init__(f"step {step} failed on stage {stage}: {message}")
        self.step = step
        self.stage = stage
        self.message = message


def check_hellos(hellos: list[dict], config_fp: str) -> None:
    """Raise LinkError naming the first mismatch among the stages' HELLOs (index = stage index)."""
    n_layers = hellos[0]["model_layers"]
    prev_end = 0
    for i, h in enumerate(hellos):
        if h.get("stage") != i:
            raise LinkError(f"stage {i}'s endpoint is answered by a stage started as --device {h.get('stage')}")
        first, last = h["layers"]
        last_stage = i == len(hellos) - 1
        if first != prev_end or last > n_layers or (last_stage and last != n_layers):
            where = f"stage {i - 1} ends at {prev_end}" if i else "the first stage must start at 0"
            raise LinkError(f"stage {i} serves layers [{first}, {last}) but {where} and the model has {n_layers} layers")
        prev_end = last
    ref = hellos[0]
    for i, h in enumerate(hellos[1:], start=1):
        if h["model_fp"] != ref["model_fp"]:
            raise LinkError(f"stage {i} has checkpoint fp {h['model_fp']}, stage 0 has {ref['model_fp']}")
        for key in GEOMETRY:
            a, b = h["pool"][key], ref["pool"][key]
            if a != b:
                what = f"{a} chunks, stage 0 has {b}" if key == "n_chunks" else f"{key} {a}, stage 0 has {b}"
                raise LinkError(f"stage {i} has {what}")
        if h["config_fp"] != ref["config_fp"]:
            raise LinkError(f"stage {i} has config fp {h['config_fp']}, stage 0 has {ref['config_fp']}")
    if ref["config_fp"] != config_fp:
        raise LinkError(f"stage 0 has config fp {ref['config_fp']}, the coordinator has {config_fp}")
