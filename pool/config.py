"""One config object for a box, built once from YAML plus `--set a.b=value` overrides.

The coordinator and every stage build it from the same file; the stage reports `fingerprint()` in its
HELLO and the coordinator refuses a stage whose fingerprint differs. Validation happens here, before any
process starts, with messages that name the key (`engine.prefill_chunk=8192 is larger than ...`).

Decisions pinned by tests/pool/test_config.py:
- Unknown keys are refused (with the closest known key as a hint); so are duplicate keys in the YAML,
  which PyYAML would otherwise resolve silently to the last one.
- `kv_pool_tokens` that is not a multiple of `chunk_cells` is rounded UP to whole chunks (`n_chunks` is a
  ceiling) and `Config.notes()` says so: the pool never holds fewer cells than asked for.
- Every address a stage binds (its `endpoint`, and the `data` endpoint of every stage after the first, which
  receive hidden states, and of the first one when it takes the last one's samples: pool/step_chain.py rule 6)
  must be distinct, and a tcp one must not be the coordinator's
  HTTP port on the same host.

Reading the YAML and applying `--set` overrides: pool/config_load.py; the endpoint checks: pool/endpoints.py
(their public names are importable from here too).
"""
from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pool import step_chain
from pool.config_load import ConfigError, apply_overrides, read_yaml
from pool.endpoints import LOOPBACK_HOSTS, MAX_IPC_PATH, check_endpoint, same_host, tcp_host_port
from pool.runtime import expand

__all__ = [
    "MAX_IPC_PATH", "BoxConfig", "Config", "ConfigError", "CoordinatorConfig", "EngineConfig", "StageConfig", "apply_overrides",
    "config_from_dict", "default_config_path", "load_config", "read_yaml",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CoordinatorConfig(_Strict):
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8080, ge=0, le=65535)  # 0 = let the OS pick a free port (tests)
    api_key: str | None = None
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    # A request head longer than this is a 400; a request not whole this long after it may start is dropped
    # (coordinator/http_limits.py).
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    request_read_timeout_s: float = Field(30.0, gt=0)
    # A stage that has not answered a ping for this long is down (issue: detected within 2 s).
    heartbeat_ms: int = Field(250, ge=10)
    stage_timeout_ms: int = Field(1500, ge=50)
    retry_after_s: int = Field(10, ge=1)
    # The least time a step may be in flight before it is given up (coordinator/deadlines.py adds its size).
    step_timeout_ms: int = Field(10000, ge=100)

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("an empty api_key would accept any client; use null to turn the check off")
        return v

    @model_validator(mode="after")
    def _heartbeat(self) -> "CoordinatorConfig":
        if self.heartbeat_ms >= self.stage_timeout_ms:
            raise ValueError(
                f"coordinator.heartbeat_ms={self.heartbeat_ms} must be smaller than coordinator.stage_timeout_ms="
                f"{self.stage_timeout_ms}: a stage would be declared down between two pings"
            )
        return self


class EngineConfig(_Strict):
    max_context: int = Field(8192, ge=16)
    parallel: int = Field(4, ge=1, le=256)
    kv_pool_tokens: int = Field(0, ge=0)
    chunk_cells: int = Field(4096, ge=1)
    kv_dtype: Literal["auto", "int8"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    prefill_chunk: int = Field(512, ge=1)
    max_waiting: int = Field(64, ge=0)
    slot_save_path: str | None = None
    threads: int = Field(0, ge=0)  # torch threads per stage; 0 = torch's default
    # A CPU stage multiplies the rows of a decode step by weights held as byte rows (a quantized GGUF, 8-bit GPTQ)
    # with the rows quantized to 8 bits per 32 values, by integer dot products, as llama.cpp does (stages/byte_rows.py
    # rule 7); false keeps float activations (the dequantized weights' product to float32 rounding).
    int8_activations: bool = True
    # Cells of the device window per stage (pool/window_plan.py): "auto" = the whole pool on CUDA when it
    # fits, off on CPU; a number turns a CPU stage's window on too.
    device_cells: int | Literal["auto"] = "auto"
    # Pool on: a new request maps full chunks of another conversation's identical prefix instead of reading
    # them again (pool/chunk_map.py rules 12-17, coordinator/prefix_sharing.py). No effect with the pool off.
    share_prefixes: bool = True
    # The next decode step is sent while the one before is in flight; the first stage reads the token the last
    # one sampled, sent to its data endpoint when they are not the same stage (pool/step_chain.py). "auto": on a
    # box of one stage only (measured gains there; none measured for several on CPU stages, docs/BENCHMARKS.md).
    chain_steps: bool | Literal["auto"] = "auto"
    # Several stages: true keeps up to S steps in flight (each stage computes another group of slots), false one
    # step at a time, each stage with all of its machine's cores; "auto": in turns when every stage is a CPU stage
    # on one machine, pipelined otherwise (pool/pipeline.py).
    pipeline: bool | Literal["auto"] = "auto"
    # Linear-attention state entries per stage (stages/state_pool.py, coordinator/linear_state.py): one per slot
    # and one per parked conversation that keeps its state; 0 = 2 x parallel. No effect on a model without them.
    state_entries: int = Field(0, ge=0)
    # More entries per such stage for copies of the state at chunk boundaries, so a prompt that branches inside a
    # held conversation reuses its prefix (coordinator/state_checkpoints.py); None = 2 x parallel, 0 = none.
    state_checkpoints: int | None = Field(None, ge=0)

    @field_validator("device_cells")
    @classmethod
    def _device_cells(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError(f"a window cannot have {v} cells; use auto, 0 (off on CPU) or a number of cells")
        return v

    @property
    def n_state_entries(self) -> int:
        return self.state_entries or 2 * self.parallel

    @property
    def n_state_checkpoints(self) -> int:
        return 2 * self.parallel if self.state_checkpoints is None else self.state_checkpoints

    @model_validator(mode="after")
    def _an_entry_per_slot(self) -> "EngineConfig":
        if self.state_entries and self.state_entries < self.parallel:
            raise ValueError(f"engine.state_entries={self.state_entries} is smaller than engine.parallel="
                             f"{self.parallel}: every slot needs a state entry of its own")
        return self

    @property
    def pool_on(self) -> bool:
        return self.kv_pool_tokens > 0

    @property
    def table_chunks(self) -> int:
        """Entries in one table: enough chunks for `max_context` cells."""
        return math.ceil(self.max_context / self.chunk_cells)

    @property
    def n_chunks(self) -> int:
        """Usable chunks per stage (the trash chunk, number `n_chunks`, comes on top).

        Pool on: ceil(kv_pool_tokens / chunk_cells) (rounded up, see `Config.notes`). Pool off (the
        baseline): `parallel + 1` fixed full-context regions, one per slot plus one for a parked conversation.
        """
        if self.pool_on:
            return math.ceil(self.kv_pool_tokens / self.chunk_cells)
        return (self.parallel + 1) * self.table_chunks

    @model_validator(mode="after")
    def _pool_holds_one_context(self) -> "EngineConfig":
        if self.pool_on and self.n_chunks < self.table_chunks:
            raise ValueError(
                f"engine.kv_pool_tokens={self.kv_pool_tokens} is smaller than one engine.max_context="
                f"{self.max_context} (in chunks of engine.chunk_cells={self.chunk_cells}: "
                f"{self.n_chunks} < {self.table_chunks}); a single conversation could never reach max_context"
            )
        if self.prefill_chunk > self.max_context:
            raise ValueError(
                f"engine.prefill_chunk={self.prefill_chunk} is larger than engine.max_context={self.max_context}: "
                f"no prompt can be that long"
            )
        return self


class StageConfig(_Strict):
    device: str = "cpu"
    layers: tuple[int, int]
    endpoint: str
    data_endpoint: str | None = None

    @field_validator("layers")
    @classmethod
    def _range(cls, v: tuple[int, int]) -> tuple[int, int]:
        if not (0 <= v[0] < v[1]):
            raise ValueError(f"layer range [{v[0]}, {v[1]}) is empty or negative")
        return v

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            v = str(v)  # `device: 0` in YAML reads as an int
        if not isinstance(v, str):
            return v
        if v != "cpu" and not v.isdigit() and not (v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit())):
            raise ValueError(f"device {v!r}: use 'cpu', a CUDA index like 0, or 'cuda:N'")
        return f"cuda:{v}" if v.isdigit() else v

    @field_validator("endpoint", "data_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return None if v is None else check_endpoint(expand(v))  # ipc://{runtime}/x: the private runtime dir

    @property
    def data(self) -> str:
        """Where this stage receives hidden states from the previous stage (the first stage: the last stage's
        samples, with chained steps on several stages: pool/step_chain.py rule 6)."""
        if self.data_endpoint:
            return self.data_endpoint
        hp = tcp_host_port(self.endpoint)
        if hp is not None:
            return f"tcp://{hp[0]}:{hp[1] + 1}"
        return self.endpoint + "-data"


def _default_stages() -> list[StageConfig]:
    return [
        StageConfig(device="cpu", layers=(0, 2), endpoint="ipc://{runtime}/stage-0"),
        StageConfig(device="cpu", layers=(2, 4), endpoint="ipc://{runtime}/stage-1"),
    ]


class BoxConfig(_Strict):
    """What makes the processes of one box one box (pool/runtime.py): the key every HELLO proves it holds."""

    key_file: str | None = None  # None: curve_dir's box.key, else <runtime dir>/box.key (made on first use)
    curve_dir: str | None = None  # `strata keygen DIR`: CURVE on every stage socket (pool/curve.py)

    @field_validator("key_file", "curve_dir")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("an empty path names no file; use null")
        return v

    @property
    def resolved_key_file(self) -> str | None:
        """The box key file: key_file, else curve_dir/box.key, else None (the runtime directory's box.key)."""
        if self.key_file:
            return self.key_file
        return str(Path(self.curve_dir).expanduser() / "box.key") if self.curve_dir else None


class Config(_Strict):
    model: str = Field("tiny", min_length=1)
    box: BoxConfig = Field(default_factory=BoxConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    stages: list[StageConfig] = Field(default_factory=_default_stages)

    @model_validator(mode="after")
    def _stages_chain(self) -> "Config":
        if not self.stages:
            raise ValueError("stages: at least one stage is needed")
        ranges = [s.layers for s in self.stages]
        for i, ((a0, a1), (b0, b1)) in enumerate(zip(ranges, ranges[1:])):
            if b0 < a0:
                raise ValueError(
                    f"stages.{i + 1}.layers=[{b0}, {b1}) starts before stages.{i}.layers=[{a0}, {a1}): "
                    f"list the stages in layer order"
                )
        if ranges[0][0] != 0:
            raise ValueError(f"stages.0.layers: {_span(0, ranges[0][0])} not served by any stage")
        for i, ((a0, a1), (b0, b1)) in enumerate(zip(ranges, ranges[1:])):
            if b0 < a1:
                raise ValueError(
                    f"stages.{i}.layers=[{a0}, {a1}) and stages.{i + 1}.layers=[{b0}, {b1}) overlap "
                    f"({_span(b0, min(a1, b1))} served twice)"
                )
            if b0 > a1:
                raise ValueError(f"stages.{i + 1}.layers: {_span(a1, b0)} not served by any stage")
        self._check_addresses()
        return self

    def _check_addresses(self) -> None:
        bound: dict[str, str] = {}  # address -> the key that binds it
        for i, s in enumerate(self.stages):
            keys = [(f"stages.{i}.endpoint", s.endpoint)]
            if i > 0 or step_chain.ring(self):  # hidden states; the first stage: the last one's samples
                data_key = f"stages.{i}.data_endpoint" if s.data_endpoint else f"stages.{i}.data (derived from the endpoint)"
                if i == 0:
                    data_key += (", where stage 0 takes the last stage's samples for chained steps; "
                                 "or leave engine.chain_steps at auto")
                keys.append((data_key, s.data))
            for key, addr in keys:
                try:
                    check_endpoint(addr)  # a derived data endpoint can overflow the port or the ipc path
                except ValueError as err:
                    raise ValueError(f"{key}: {err}; set stages.{i}.data_endpoint") from None
                hp = tcp_host_port(addr)
                if addr in bound:
                    raise ValueError(f"{key}: {addr} is already bound by {bound[addr]}")
                bound[addr] = key
                c = self.coordinator
                if hp is not None and hp[0] not in LOOPBACK_HOSTS and not self.box.curve_dir:
                    raise ValueError(f"{key}: {addr} would carry the stage protocol across a network in clear; set "
                                     f"box.curve_dir (made by `strata keygen DIR`) or use a loopback host")
                if hp is not None and hp[1] == c.port and same_host(hp[0], c.host):
                    raise ValueError(f"{key}: {addr} is the coordinator's HTTP port (coordinator.port={c.port})")

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    def check_layers(self, num_hidden_layers: int) -> None:
        """The stages must cover the checkpoint's layers exactly once (the chain is checked on load)."""
        n, key = self.num_layers, f"stages.{len(self.stages) - 1}.layers"
        if n != num_hidden_layers:
            what = (f"{_span(num_hidden_layers, n)} not in the model" if n > num_hidden_layers
                    else f"{_span(n, num_hidden_layers)} not served by any stage")
            raise ConfigError(
                f"{key}: the stages cover layers [0, {n}) but the model has {num_hidden_layers} layers: {what}", key=key
            )

    def notes(self) -> list[str]:
        """Remarks that do not stop the config: rounding and choices worth a second look."""
        e, out = self.engine, []
        if e.pool_on and e.kv_pool_tokens % e.chunk_cells:
            out.append(
                f"engine.kv_pool_tokens={e.kv_pool_tokens} is not a multiple of engine.chunk_cells={e.chunk_cells}: "
                f"rounded up to {e.n_chunks} chunks = {e.n_chunks * e.chunk_cells} cells"
            )
        if e.pool_on and e.n_chunks >= (e.parallel + 1) * e.table_chunks:
            out.append(
                f"engine.kv_pool_tokens={e.kv_pool_tokens} is no smaller than (parallel + 1) x max_context: "
                f"the pool saves no memory over the baseline"
            )
        if e.chunk_cells > e.max_context:
            out.append(f"engine.chunk_cells={e.chunk_cells} exceeds engine.max_context={e.max_context}: "
                       f"each table holds one partly used chunk")
        devices = [s.device for s in self.stages if s.device != "cpu"]
        for d in sorted({d for d in devices if devices.count(d) > 1}):
            out.append(f"stages: several stages on {d} share its memory")
        return out

    def fingerprint(self) -> str:
        """Hash of everything both sides must agree on (not the HTTP front's settings)."""
        body = {"model": self.model, "engine": self.engine.model_dump(), "stages": [s.model_dump() for s in self.stages]}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _span(first: int, end: int) -> str:
    """Layers [first, end) in words: "layer 3 is" / "layers 3..5 are"."""
    return f"layer {first} is" if end - first == 1 else f"layers {first}..{end - 1} are"


_SECTIONS: dict[str, type[BaseModel]] = {"box": BoxConfig, "coordinator": CoordinatorConfig, "engine": EngineConfig, "stages": StageConfig}


_KEY_AT_START = re.compile(r"([a-z_]+(?:\.[a-z0-9_]+)*)")


def _suggest(loc: tuple, name: str) -> str:
    section = _SECTIONS.get(str(loc[0])) if len(loc) > 1 else Config
    if section is None:
        return ""
    close = difflib.get_close_matches(name, list(section.model_fields), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _format_errors(err: ValidationError) -> tuple[str, str | None]:
    """One clause per error, each naming its key; also the first key, for ConfigError.key."""
    lines, keys = [], []
    for e in err.errors():
        loc, msg = ".".join(str(p) for p in e["loc"]), e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key" + _suggest(e["loc"], str(e["loc"][-1]))
        elif e["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
            named = _KEY_AT_START.match(msg)
            if named and named.group(1).split(".")[0] in Config.model_fields:
                loc = named.group(1)  # a check across keys: its message starts with the key it blames
                lines.append(msg)
                keys.append(loc)
                continue
        elif e["type"] != "missing" and isinstance(e.get("input"), (str, int, float, bool, type(None))):
            msg += f" (got {e['input']!r})"
        lines.append(f"{loc}: {msg}" if loc else msg)
        keys.append(loc)
    return "; ".join(lines), next((k for k in keys if k), None)


def config_from_dict(data: dict, overrides: list[str] | None = None) -> Config:
    """Validate a plain dict (as read from YAML) after applying `--set` overrides; ConfigError names the key."""
    data = json.loads(json.dumps(data))
    overrides = overrides or []
    if "stages" not in data and any(o.startswith("stages.") for o in overrides):
        # `--set stages.1.device=cuda:1` on a file without stages: override the default stages.
        data["stages"] = [s.model_dump(mode="json", exclude_none=True) for s in _default_stages()]
    data = apply_overrides(data, overrides)
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        message, key = _format_errors(err)
        raise ConfigError(f"config: {message}", key=key) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read `path` (None = all defaults), apply `--set` overrides, validate."""
    data = read_yaml(path) if path is not None else {}
    return config_from_dict(data, overrides)


def default_config_path() -> Path:
    """configs/cpu-tiny.yaml of the source tree: the embedded default box (two CPU stages, pool on)."""
    return Path(__file__).resolve().parent.parent / "configs" / "cpu-tiny.yaml"
