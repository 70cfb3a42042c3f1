"""Request bodies of the OpenAI and Anthropic routes, as pydantic models.

Rules:
- Every field of the OpenAI and Anthropic APIs either works or is refused: a wrong type or range, or a
  feature this server does not have yet, becomes HTTP 400 whose message and `param` name the field
  (`validation_message`), never FastAPI's 422 and never a silent no-op. A field of a feature not implemented
  yet (unsupported_fields.py: audio, predicted outputs, the deprecated `functions`, ...) passes only when null
  or at a value that asks for nothing (`functions: []`, `store: false`); the same
  goes for vLLM's and llama.cpp's extensions that clients written for those servers send. Fields that only describe the
  request (`user`, `metadata`, `safety_identifier`, `prompt_cache_key`, Anthropic `cache_control` markers:
  the prefix cache here is automatic) are type-checked and change nothing by their own definition. Names
  that belong to neither API are ignored. Tools, tool choices, response formats, template variables and
  Anthropic thinking are checked by schemas_tools.py.
- OpenAI message content arrives as a string or a list of text parts; it is normalised to one string here, and
  any other part type (images, audio) is refused with a message naming it. Anthropic content blocks become
  chat-template messages in schemas_tools.anthropic_messages (text, tool_use, tool_result, thinking).
- `logit_bias` (OpenAI routes): at most `MAX_LOGIT_BIAS` entries {"token id": bias}, bias in [-100, 100];
  -100 bans the token (stages/sampling.py). The ids are checked against the vocabulary by the front.
- Only what the engine can do is accepted: n == 1, at most `MAX_STOPS_OPENAI` stop strings (OpenAI's own
  limit), at most `MAX_STOPS_ANTHROPIC` stop sequences, one prompt per completion request.
- Numbers travel to the stages in msgpack and torch tensors, so every one is bounded here: `seed` and `top_k`
  fit int64 (a top_k past the vocabulary keeps every token), `repetition_penalty` is at most
  `MAX_REPETITION_PENALTY`. An unbounded value would otherwise fail a step, or the scheduler, far from the request.
  A temperature below `GREEDY_BELOW` is sent as 0 (greedy), as vLLM does: the stages sample in float32, where
  a temperature of 1e-38 or less is 0 or subnormal and the division yields no usable distribution.
- `ignore_eos` (the vLLM / llama.cpp extension, OpenAI routes only): the model's end-of-sequence ids do not end
  the request (its GenRequest has no stop ids); stop strings and max_tokens still do. A bool, like `stream`.
- `/openapi.json` describes every body with these models (`json_body`, `openapi_schemas`), so a schema-driven
  fuzzer generates meaningful requests; the routes still read the body themselves (`Front.parse`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, WithJsonSchema, field_validator,
                      model_validator)
from pydantic.json_schema import models_json_schema

from . import schemas_tools as tf
from . import unsupported_fields as unsupported
from .engine import SAMPLING_DEFAULTS

MAX_STOPS_OPENAI = 4
MAX_STOPS_ANTHROPIC = 16
MAX_TOP_LOGPROBS = 20
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 300  # entries of one request's logit_bias: they travel in the step header that starts it
MAX_BIAS = 100.0
GREEDY_BELOW = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_TEXT_PARTS = {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                          "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}
TextContent = Annotated[str, WithJsonSchema({"anyOf": [{"type": "string"}, _TEXT_PARTS]})]
"""A string, or a list of text parts joined into one by `_join_text_parts` (what the schema shows)."""

# What the validators below accept, for the OpenAPI schema (a fuzzer reads it to make valid requests).
_NONEMPTY = {"type": "string", "minLength": 1}
_NULL = {"type": "null"}


def _stops_schema(limit: int, single: bool) -> dict:
    many = {"type": "array", "items": _NONEMPTY, "maxItems": limit}
    return {"json_schema_extra": {"anyOf": [_NONEMPTY, many, _NULL] if single else [many, _NULL]}}


def _only(value: Any) -> dict:
    return {"json_schema_extra": {"anyOf": [{"const": value}, _NULL]}}


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem of a body: "temperature: Input should be a valid number"."""
    problems = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        problems.append((f"{loc}: {msg}" if loc else msg, loc or None))
    first_param = problems[0][1] if problems else None
    return "; ".join(p for p, _ in problems), first_param


def _join_text_parts(value: Any, what: str) -> Any:
    """A string stays; a list of {"type": "text", "text": ...} parts becomes their texts joined with "\\n"
    (as vLLM and `tokenizer.normalize_messages` join them)."""
    if value is None or isinstance(value, str) or not isinstance(value, list):
        return value
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise ValueError(f"{what} part {i} must be an object")
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"{what} part {i} has type {kind!r}; only 'text' parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{what} part {i}: 'text' must be a string")
        texts.append(text)
    return "\n".join(texts)


def _stop_list(value: Any, limit: int) -> list[str]:
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > limit:
        raise ValueError(f"at most {limit} stop strings are supported, got {len(stops)}")
    if any(not s for s in stops):
        raise ValueError("stop strings must not be empty")
    return stops


def _greedy_floor(sampling: dict) -> dict:
    if sampling["temperature"] < GREEDY_BELOW:
        sampling["temperature"] = 0.0
    return sampling


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# ---- OpenAI ------------------------------------------------------------------------------------------
class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: unsupported.Obfuscation = None


class _OpenAISampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # -1 and 0: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    n: int | None = Field(None, **_only(1))
    stop: str | list[str] | None = Field(None, validate_default=True, **_stops_schema(MAX_STOPS_OPENAI, True))
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"anyOf": [{
        "type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,9}$"},
        "additionalProperties": {"type": "number", "minimum": -MAX_BIAS, "maximum": MAX_BIAS}}, _NULL]})
    user: str | None = None
    ignore_eos: bool = False
    response_format: tf.ResponseFormat | None = None
    # what this server does not do yet (see the module docstring)
    service_tier: unsupported.ServiceTier = None
    min_tokens: unsupported.MinTokens = None
    stop_token_ids: unsupported.StopTokenIds = None
    include_stop_str_in_output: unsupported.IncludeStop = None
    skip_special_tokens: unsupported.SkipSpecial = None
    spaces_between_special_tokens: unsupported.SkipSpecial = None
    prompt_logprobs: unsupported.PromptLogprobs = None
    bad_words: unsupported.BadWords = None
    allowed_token_ids: unsupported.AllowedTokens = None
    use_beam_search: unsupported.BeamSearch = None
    length_penalty: unsupported.LengthPenalty = None
    typical_p: unsupported.TypicalP = None
    guided_json: unsupported.Guided = None
    guided_regex: unsupported.Guided = None
    guided_choice: unsupported.Guided = None
    guided_grammar: unsupported.Guided = None
    structured_outputs: unsupported.Guided = None
    grammar: unsupported.Guided = None
    json_schema: unsupported.Guided = None

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries are supported, got {len(v)}")
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (decimal integers), got {key!r}")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ValueError(f"a bias must be in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("stop", mode="after")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        return _stop_list(v, MAX_STOPS_OPENAI)

    def sampling(self) -> dict:
        """The engine's sampling dict (`engine.SAMPLING_DEFAULTS` keys); unset fields keep the defaults."""
        out = dict(SAMPLING_DEFAULTS)
        for key in SAMPLING_DEFAULTS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out["top_k"] = max(0, out["top_k"])
        out["logit_bias"] = sorted([int(k), b] for k, b in self.logit_bias.items()) if self.logit_bias else None
        return _greedy_floor(out)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _content_required(schema: dict) -> None:
    """The schema asks every message for content; the model lets an assistant turn go without."""
    schema["required"] = ["role", "content"]
    schema["properties"]["content"] = {"anyOf": [{"type": "string"}, _TEXT_PARTS]}


class ChatMessage(_Body):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_content_required)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: TextContent | None = None
    name: str | None = None
    tool_calls: list[tf.MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier turn's reasoning, as vLLM returns it
    function_call: unsupported.MessageFunctionCall = None
    audio: unsupported.MessageAudio = None
    refusal: unsupported.Refusal = None

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return _join_text_parts(v, "content")

    @model_validator(mode="after")
    def _needs_content(self) -> "ChatMessage":
        """Only an assistant turn may come without content (OpenAI's rule: it may carry tool calls instead);
        tool calls belong to assistant turns, a tool_call_id to tool results."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only an assistant message carries tool_calls, not a {self.role} message")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"only a tool message carries a tool_call_id, not a {self.role} message")
        return self

    def as_template_message(self) -> dict:
        """The dict a chat template reads; `developer` is OpenAI's newer name for `system`."""
        role = "system" if self.role == "developer" else self.role
        msg = {"role": role, "content": self.content or ""}
        if self.name:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [c.template_form() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        return msg


class ChatRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    tools: list[tf.OpenAITool] | None = None
    tool_choice: tf.OpenAIToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: unsupported.Functions = None
    function_call: unsupported.FunctionCall = None
    audio: unsupported.Audio = None
    modalities: unsupported.Modalities = None
    prediction: unsupported.Prediction = None
    reasoning_effort: unsupported.Reasoning = None
    verbosity: unsupported.Verbosity = None
    web_search_options: unsupported.WebSearch = None
    moderation: unsupported.Moderation = None
    store: unsupported.Store = None
    prompt_cache_retention: unsupported.PromptCacheControl = None
    prompt_cache_options: unsupported.PromptCacheControl = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: unsupported.GenerationPrompt = None
    continue_final_message: unsupported.ContinueFinal = None
    echo: unsupported.ChatEcho = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict | None) -> dict | None:
        return tf.template_kwargs(v)

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, v: list | None) -> list | None:
        return tf.distinct_tools(v)

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v: Any, info: ValidationInfo) -> Any:
        tf.openai_choice([t.spec() for t in info.data.get("tools") or []], v, None)  # raises for a bad one
        return v

    @property
    def tool_specs(self) -> list[tf.ToolSpec]:
        return [t.spec() for t in self.tools or []]

    @property
    def chosen_tools(self) -> tf.ToolChoice:
        return tf.openai_choice(self.tool_specs, self.tool_choice, self.parallel_tool_calls)

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("is only allowed with logprobs: true")
        return v

    @property
    def completion_limit(self) -> int | None:
        """`max_completion_tokens` (the newer name) wins over `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] = Field(json_schema_extra={"anyOf": [
        _NONEMPTY, {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]})
    echo: bool = Field(False, json_schema_extra={"const": False})
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, **_only(1))
    suffix: str | None = Field(None, json_schema_extra={"anyOf": [{"type": "string", "maxLength": 0}, _NULL]})

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        """A string, a list of token ids, or a batch of exactly one of those."""
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt is empty")
            if all(isinstance(x, (str, list)) for x in v):
                if len(v) != 1:
                    raise ValueError(f"one prompt per request is supported, got {len(v)}")
                return v[0]
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError(f"only best_of=1 is supported, got {v}")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v


# ---- Anthropic ---------------------------------------------------------------------------------------
_BLOCKS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "required": ["type"]}}]}


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Annotated[str | list[dict], WithJsonSchema(_BLOCKS)]

    @field_validator("content", mode="after")
    @classmethod
    def _blocks(cls, v: Any, info: ValidationInfo) -> Any:
        tf.anthropic_messages(info.data.get("role", "user"), v, "content")  # raises for a block it cannot take
        return v

    def template_messages(self) -> list[dict]:
        return tf.anthropic_messages(self.role, self.content, "content")


class _AnthropicPrompt(_Body):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: TextContent | None = None
    cache_control: dict | None = None  # the prefix cache is automatic: a marker changes nothing
    tools: list[tf.AnthropicTool] | None = None
    tool_choice: tf.AnthropicToolChoiceBody | None = None
    thinking: tf.ThinkingConfig | None = None
    output_config: unsupported.OutputConfig = None
    speed: unsupported.Speed = None
    mcp_servers: unsupported.McpServers = None
    context_management: unsupported.ContextManagement = None
    workspace_id: unsupported.Workspace = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, v: Any) -> Any:
        return _join_text_parts(v, "system block")

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, v: list | None) -> list | None:
        return tf.distinct_tools(v)

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v: Any, info: ValidationInfo) -> Any:
        tf.anthropic_choice([t.spec() for t in info.data.get("tools") or []], v)  # raises for a bad one
        return v

    @property
    def tool_specs(self) -> list[tf.ToolSpec]:
        return [t.spec() for t in self.tools or []]

    @property
    def chosen_tools(self) -> tf.ToolChoice:
        return tf.anthropic_choice(self.tool_specs, self.tool_choice)

    @property
    def thinking_budget(self) -> int | None:
        """Tokens the reasoning may take when `thinking` is enabled; None when it is not."""
        return self.thinking.budget_tokens if self.thinking and self.thinking.type == "enabled" else None

    def template_messages(self) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for m in self.messages:
            msgs += m.template_messages()
        return msgs


class MessagesRequest(_AnthropicPrompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, validate_default=True, **_stops_schema(MAX_STOPS_ANTHROPIC, False))
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT64_MAX)
    stream: bool = False
    metadata: dict | None = None
    user_profile_id: str | None = None
    service_tier: unsupported.AnthropicServiceTier = None
    container: unsupported.Container = None
    diagnostics: unsupported.Diagnostics = None
    inference_geo: unsupported.InferenceGeo = None

    @field_validator("stop_sequences", mode="after")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str]:
        return _stop_list(v, MAX_STOPS_ANTHROPIC)

    def sampling(self) -> dict:
        out = dict(SAMPLING_DEFAULTS)
        for key in ("temperature", "top_p", "top_k"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return _greedy_floor(out)


class CountTokensRequest(_AnthropicPrompt):
    pass


# ---- OpenAPI -----------------------------------------------------------------------------------------
BODY_MODELS: tuple[type[BaseModel], ...] = (ChatRequest, CompletionRequest, MessagesRequest, CountTokensRequest)
_REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route that reads `model` from its JSON body (the route parses it itself)."""
    ref = _REF.format(model=model.__name__)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}}


def openapi_schemas(max_context: int, vocab_size: int, served: list[str]) -> dict[str, dict]:
    """components.schemas for every body model and the models they nest, as `json_body` refers to them,
    with this server's limits: max_tokens below `max_context`, token ids below `vocab_size`, an OpenAI
    `model` among the `served` names (Anthropic clients may name any model)."""
    _, top = models_json_schema([(m, "validation") for m in BODY_MODELS], ref_template=_REF)
    defs = top["$defs"]
    for name in ("ChatRequest", "CompletionRequest"):
        defs[name]["properties"]["model"]["anyOf"] = [{"enum": list(served)}, _NULL]
    for model in defs.values():
        props = model.get("properties", {})
        for name in ("max_tokens", "max_completion_tokens"):
            for branch in props.get(name, {}).get("anyOf", [props.get(name, {})]):
                if branch.get("type") == "integer":
                    branch["maximum"] = max_context - 1
        for branch in props.get("prompt", {}).get("anyOf", []):
            if branch.get("type") == "array":
                branch["items"]["maximum"] = vocab_size - 1
    return defs
