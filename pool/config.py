"""One config object for a box, built once from YAML plus `--set a.b=value` overrides.

The coordinator and every stage build it from the same file; the stage reports `fingerprint()` in its
HELLO and the coordinator refuses a stage whose fingerprint differs. Validation happens here, before any
process starts, with messages that name the key.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config that cannot be served; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CoordinatorConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    api_key: str | None = None
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    # A stage that has not answered a ping for this long is down (issue: detected within 2 s).
    heartbeat_ms: int = Field(250, ge=10)
    stage_timeout_ms: int = Field(1500, ge=50)
    retry_after_s: int = Field(10, ge=1)


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

        Pool on: ceil(kv_pool_tokens / chunk_cells). Pool off (the baseline): `parallel + 1` fixed
        full-context regions, one per slot plus one for a parked conversation.
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

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "cpu" and not v.startswith("cuda") and not v.isdigit():
            raise ValueError(f"device {v!r}: use 'cpu', a CUDA index like 0, or 'cuda:N'")
        return f"cuda:{v}" if v.isdigit() else v

    @property
    def data(self) -> str:
        """Where this stage receives hidden states from the previous stage."""
        if self.data_endpoint:
            return self.data_endpoint
        if self.endpoint.startswith("tcp://"):
            host, port = self.endpoint[len("tcp://"):].rsplit(":", 1)
            return f"tcp://{host}:{int(port) + 1}"
        return self.endpoint + "-data"


def _default_stages() -> list[StageConfig]:
    return [
        StageConfig(device="cpu", layers=(0, 2), endpoint="ipc:///tmp/strata-stage-0"),
        StageConfig(device="cpu", layers=(2, 4), endpoint="ipc:///tmp/strata-stage-1"),
    ]


class Config(_Strict):
    model: str = "tiny"
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    stages: list[StageConfig] = Field(default_factory=_default_stages)

    @model_validator(mode="after")
    def _stages_chain(self) -> "Config":
        if not self.stages:
            raise ValueError("stages: at least one stage is needed")
        ranges = sorted(s.layers for s in self.stages)
        if ranges != [s.layers for s in self.stages]:
            raise ValueError("stages: list the stages in layer order")
        if ranges[0][0] != 0:
            raise ValueError(f"stages: layers 0..{ranges[0][0]} are not served by any stage")
        for (a0, a1), (b0, b1) in zip(ranges, ranges[1:]):
            if b0 < a1:
                raise ValueError(f"stages: layer ranges [{a0}, {a1}) and [{b0}, {b1}) overlap")
            if b0 > a1:
                raise ValueError(f"stages: layers {a1}..{b0} are not served by any stage")
        endpoints = [s.endpoint for s in self.stages]
        if len(set(endpoints)) != len(endpoints):
            raise ValueError("stages: two stages share an endpoint")
        return self

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    def check_layers(self, num_hidden_layers: int) -> None:
        """The stages must cover the checkpoint's layers exactly once."""
        if self.num_layers != num_hidden_layers:
            raise ConfigError(
                f"stages: cover layers [0, {self.num_layers}) but the model has {num_hidden_layers} layers"
            )

    def fingerprint(self) -> str:
        """Hash of everything both sides must agree on (not the HTTP front's settings)."""
        body = {"model": self.model, "engine": self.engine.model_dump(), "stages": [s.model_dump() for s in self.stages]}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`a.b=value` sets data["a"]["b"]; the value is read as YAML (numbers, null, lists)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. engine.kv_pool_tokens=8192")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            if part.isdigit() and isinstance(node, list):
                node = node[int(part)]
                continue
            node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"--set {key}: {part} is not a section")
        last = parts[-1]
        if last.isdigit() and isinstance(node, list):
            node[int(last)] = _parse_value(value)
        else:
            node[last] = _parse_value(value)
    return data


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(lines)


def config_from_dict(data: dict, overrides: list[str] | None = None) -> Config:
    data = apply_overrides(json.loads(json.dumps(data)), overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"config: {_format_errors(err)}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    data: dict = {}
    if path is not None:
        text = Path(path).read_text()
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    return config_from_dict(data, overrides)
