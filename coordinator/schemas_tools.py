"""Request fields for tools, structured output and reasoning, as pydantic models (schemas.py uses them).

Rules:
- OpenAI `tools` are `{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}`;
  Anthropic `tools` are `{"name", "description"?, "input_schema"}` (custom tools; a server tool such as
  `web_search_20250305` is refused by name). A name is 1-64 of [A-Za-z0-9_-] (both APIs' rule), names are
  distinct, a parameters / input schema is a JSON object whose `type`, when given, is "object". Both become
  one list of `ToolSpec`s: what the chat template renders and what a grammar constrains.
- `tool_choice`: OpenAI "none" | "auto" | "required" | {"type": "function", "function": {"name"}}; Anthropic
  {"type": "auto" | "any" | "tool" | "none", "name"? (tool only), "disable_parallel_tool_use"?}. A named tool
  must be one of `tools`; a choice other than none / auto without tools is a 400 (OpenAI's rule). Both become
  a `ToolChoice`: mode "none" | "auto" | "required" | "named" and, for named, the tool.
- `response_format` (OpenAI): {"type": "text"} | {"type": "json_object"} | {"type": "json_schema",
  "json_schema": {"name", "description"?, "schema"?, "strict"?}}; the name follows the tool-name rule.
- `chat_template_kwargs` (vLLM's extension): extra variables for the chat template (e.g. `enable_thinking`);
  names the template gets anyway (messages, tools, add_generation_prompt, ...) are refused.
- Anthropic `thinking`: {"type": "disabled"} or {"type": "enabled", "budget_tokens": N}, N >= 1024 and below
  `max_tokens` (Anthropic's rules; checked by the request that holds both).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MIN_THINKING_BUDGET = 1024
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "raise_exception",
                                    "strftime_now", "continue_final_message"})


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


@dataclass(frozen=True)
class ToolSpec:
    """One tool as both APIs describe it: a name, what it does, the JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict

    def template_form(self) -> dict:
        """The OpenAI form chat templates are written for (transformers passes tools this way)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None
    parallel: bool = True


def _check_name(v: str, what: str = "a name") -> str:
    if not NAME.match(v):
        raise ValueError(f"{what} must be 1-64 characters of letters, digits, '_' and '-', got {v!r}")
    return v


def _check_schema(v: dict) -> dict:
    if "type" in v and v["type"] != "object":
        raise ValueError(f"must be a JSON schema of an object (type \"object\"), got type {v['type']!r}")
    return v


def distinct_tools(tools: list | None) -> list | None:
    """A request's `tools` (OpenAITool or AnthropicTool bodies) if their names are distinct."""
    if tools:
        distinct_names([t.spec() for t in tools])
    return tools


def distinct_names(tools: list[ToolSpec]) -> list[ToolSpec]:
    seen: set[str] = set()
    for t in tools:
        if t.name in seen:
            raise ValueError(f"tool names must be distinct; {t.name!r} appears twice")
        seen.add(t.name)
    return tools


# ---- OpenAI ------------------------------------------------------------------------------------------
class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v)

    @field_validator("parameters")
    @classmethod
    def _params(cls, v: dict | None) -> dict | None:
        return v if v is None else _check_schema(v)


class OpenAITool(_Body):
    type: str
    function: FunctionDef

    @field_validator("type")
    @classmethod
    def _function_only(cls, v: str) -> str:
        if v != "function":
            raise ValueError(f"only 'function' tools are supported, got {v!r}")
        return v

    def spec(self) -> ToolSpec:
        f = self.function
        return ToolSpec(f.name, f.description or "", f.parameters or {"type": "object", "properties": {}})


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


OpenAIToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def openai_choice(tools: list[ToolSpec], choice: Any, parallel: bool | None) -> ToolChoice:
    """The request's ToolChoice; ValueError (the caller names `tool_choice`) for a choice the tools cannot meet."""
    if choice is None:
        mode, name = ("auto" if tools else "none"), None
    elif isinstance(choice, NamedToolChoice):
        mode, name = "named", choice.function.name
    else:
        mode, name = choice, None
    if mode in ("required", "named") and not tools:
        raise ValueError(f"{mode if mode == 'required' else 'a named function'} needs `tools`")
    if name is not None and name not in {t.name for t in tools}:
        raise ValueError(f"names {name!r}, which is not one of the tools ({', '.join(t.name for t in tools)})")
    return ToolChoice(mode, name, True if parallel is None else parallel)


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v)


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _checked(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs `json_schema`")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"`json_schema` is only for type 'json_schema', not {self.type!r}")
        return self


def template_kwargs(v: dict | None) -> dict | None:
    if v is None:
        return v
    for key in v:
        if not key.isidentifier():
            raise ValueError(f"keys must be template variable names, got {key!r}")
        if key in RESERVED_TEMPLATE_VARS:
            raise ValueError(f"{key!r} is set by the server, not by chat_template_kwargs")
    return v


# ---- Anthropic ---------------------------------------------------------------------------------------
class AnthropicTool(_Body):
    name: str
    description: str | None = None
    input_schema: dict
    type: str | None = None
    cache_control: dict | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v)

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, v: dict) -> dict:
        return _check_schema(v)

    @field_validator("type")
    @classmethod
    def _custom_only(cls, v: str | None) -> str | None:
        if v not in (None, "custom"):
            raise ValueError(f"server tools are not supported; only custom tools (no type, or 'custom'), got {v!r}")
        return v

    def spec(self) -> ToolSpec:
        return ToolSpec(self.name, self.description or "", self.input_schema)


class AnthropicToolChoiceBody(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


def anthropic_choice(tools: list[ToolSpec], choice: AnthropicToolChoiceBody | None) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if choice.name is None:
            raise ValueError("type 'tool' needs `name`")
        if choice.name not in {t.name for t in tools}:
            raise ValueError(f"names {choice.name!r}, which is not one of the tools")
        return ToolChoice("named", choice.name, parallel)
    if choice.name is not None:
        raise ValueError(f"`name` is only for type 'tool', not {choice.type!r}")
    if choice.type == "any":
        if not tools:
            raise ValueError("type 'any' needs `tools`")
        return ToolChoice("required", None, parallel)
    return ToolChoice(choice.type if tools else "none", None, parallel)


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=MIN_THINKING_BUDGET)

    @model_validator(mode="after")
    def _checked(self) -> "ThinkingConfig":
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("type 'enabled' needs `budget_tokens`")
        if self.type == "disabled" and self.budget_tokens is not None:
            raise ValueError("`budget_tokens` is only for type 'enabled'")
        return self


# ---- messages that carry tool calls and results -------------------------------------------------------
class CallFunction(_Body):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _object(cls, v: str) -> str:
        json_object(v, "arguments")
        return v


class MessageToolCall(_Body):
    """An assistant's earlier tool call, as the OpenAI API returned it (arguments: a JSON object text)."""

    id: str
    type: Literal["function"] = "function"
    function: CallFunction

    def template_form(self) -> dict:
        """The form chat templates read: arguments as a mapping (transformers' convention; a template that
        wants the text writes `| tojson`, and Qwen's accept either)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": json.loads(self.function.arguments)}}


def json_object(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be the text of a JSON object, got {text[:80]!r}")
    return value


_ANTHROPIC_REFUSED = {"image": "images", "document": "documents", "search_result": "search results",
                      "redacted_thinking": "redacted thinking blocks", "server_tool_use": "server tools",
                      "web_search_tool_result": "server tools", "mcp_tool_use": "MCP tools",
                      "mcp_tool_result": "MCP tools", "container_upload": "containers"}


def _block_text(content: Any, where: str) -> str:
    """A tool_result's content: a string or a list of text blocks, joined with "\\n"."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text blocks")
    texts = []
    for i, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise ValueError(f"{where}[{i}]: only text blocks are supported in a tool result, got {kind!r}")
        texts.append(b["text"])
    return "\n".join(texts)


def anthropic_messages(role: str, content: Any, where: str) -> list[dict]:
    """One Anthropic message as chat-template messages: text blocks joined; an assistant's `tool_use` blocks
    become its `tool_calls`, its `thinking` blocks its `reasoning_content`; a user's `tool_result` blocks become
    `tool` messages (in order, before the user's own text, as the tool results answer the previous turn)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content blocks")
    texts, calls, thinking, results = [], [], [], []
    for i, b in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(b, dict):
            raise ValueError(f"{at} must be an object")
        kind = b.get("type")
        if not isinstance(kind, str):
            raise ValueError(f"{at}.type must be a string")
        if kind in _ANTHROPIC_REFUSED:
            raise ValueError(f"{at} has type {kind!r}: {_ANTHROPIC_REFUSED[kind]} are not supported by this server")
        if kind == "text":
            if not isinstance(b.get("text"), str):
                raise ValueError(f"{at}.text must be a string")
            texts.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise ValueError(f"{at}: a tool_use block needs a string `id` and `name`")
            if not isinstance(b.get("input"), dict):
                raise ValueError(f"{at}.input must be an object")
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}})
        elif kind == "thinking" and role == "assistant":
            if not isinstance(b.get("thinking"), str):
                raise ValueError(f"{at}.thinking must be a string")
            thinking.append(b["thinking"])
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise ValueError(f"{at}: a tool_result block needs a string `tool_use_id`")
            text = _block_text(b.get("content"), f"{at}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "content": text, "tool_call_id": b["tool_use_id"]})
        else:
            raise ValueError(f"{at} has type {kind!r}, which a {role} message cannot hold")
    out = list(results)
    if role == "assistant":
        msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["reasoning_content"] = "\n".join(thinking)
        out.append(msg)
    elif texts or not results:
        out.append({"role": role, "content": "\n".join(texts)})
    return out
