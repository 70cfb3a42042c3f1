"""The request fields of features this server does not implement yet, as pydantic field types.

A field typed `not_yet(feature, *noop)` passes when null or equal (as JSON: 1 == 1.0, true != 1) to one of
the `noop` values, those that ask for nothing (`tools: []`, `tool_choice: "none"`); any other value is
refused with "<field>: <feature> is not supported yet by this server; leave it out or send ...", which the
front answers with a 400 naming the field (schemas.validation_message). The OpenAPI schema of such a field
lists only the values that pass, so a schema-driven fuzzer's valid requests stay valid.
"""
from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, WithJsonSchema

_NULL = {"type": "null"}


def same_json(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true != 1 and "1" != 1."""
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def not_yet(feature: str, *noop: Any) -> Any:
    """The type of a field whose feature this server does not implement yet: null and the `noop` values
    (those that ask for nothing) pass; anything else is refused with a message naming the field."""
    hint = "leave it out" + (" or send " + " or ".join(json.dumps(v) for v in noop) if noop else "")

    def check(value: Any) -> Any:
        if value is None or any(same_json(value, n) for n in noop):
            return value
        raise ValueError(f"{feature} is not supported yet by this server; {hint}")

    return Annotated[Any, AfterValidator(check), WithJsonSchema({"anyOf": [*({"const": n} for n in noop), _NULL]})]


# OpenAI
Functions = not_yet("function calling", [])
FunctionCall = not_yet("function calling", "none", "auto")
Audio = not_yet("audio output")
Modalities = not_yet("an output modality other than text", ["text"])
Prediction = not_yet("predicted outputs")
Reasoning = not_yet("reasoning controls")
Verbosity = not_yet("verbosity control")
WebSearch = not_yet("web search")
Moderation = not_yet("moderation")
Store = not_yet("storing completions", False)
ServiceTier = not_yet("a service tier", "auto", "default")
PromptCacheControl = not_yet("prompt cache retention control")
Obfuscation = not_yet("stream obfuscation", False)
# vLLM's and llama.cpp's extensions
MinTokens = not_yet("a minimum completion length", 0)
StopTokenIds = not_yet("stopping on token ids", [])
IncludeStop = not_yet("returning the stop string", False)
SkipSpecial = not_yet("keeping special tokens in the output", True)
PromptLogprobs = not_yet("prompt logprobs")
BadWords = not_yet("banning words", [])
AllowedTokens = not_yet("restricting the output to token ids")
BeamSearch = not_yet("beam search", False)
LengthPenalty = not_yet("a length penalty", 1.0)
TypicalP = not_yet("typical sampling", 1.0)
Guided = not_yet("guided decoding")
GenerationPrompt = not_yet("a prompt without the assistant turn", True)
ContinueFinal = not_yet("continuing the final message", False)
ChatEcho = not_yet("echoing the prompt", False)
MessageFunctionCall = not_yet("function calling")
MessageAudio = not_yet("audio")
Refusal = not_yet("an assistant refusal")
# Anthropic
OutputConfig = not_yet("output configuration", {})
Speed = not_yet("a speed mode", "standard")
AnthropicServiceTier = not_yet("a service tier", "auto", "standard_only")
Container = not_yet("containers")
Diagnostics = not_yet("diagnostics")
InferenceGeo = not_yet("an inference region")
McpServers = not_yet("MCP servers", [])
ContextManagement = not_yet("context management")
Workspace = not_yet("workspaces")
