"""Which grammar a chat answer must follow, from the request: response_format, a forced tool choice, a budget.

Rules:
1. `response_format` {"type": "json_object"} -> any JSON object; {"type": "json_schema"} -> its schema (strict or
   not as asked; no schema means any JSON value of an object type); {"type": "text"} or none -> no constraint.
2. tool_choice "required" (Anthropic "any") -> one or more calls to any of the tools (exactly one when
   parallel_tool_calls is false / disable_parallel_tool_use); a named tool -> calls of that tool only. The
   calls are written in the template's family format (tool_parsers.py), so the answer parses back into them.
   A forced tool choice takes precedence over response_format: the answer is then the calls, no content.
3. "auto" and "none" constrain nothing (the model decides; the parser finds the calls it writes).
4. When the prompt opens a reasoning section (answers.AnswerPlan.inside) or a thinking budget is given, a
   constraint applies to the answer after the section: the grammar lets the section run free and then
   constrains what follows; a budget alone is a grammar too, whose Matcher forces the close marker at the
   budget (grammar.py rule 5, thinking_budget.py). Otherwise
   the constraint starts at the first token (a model that was not asked to think is not let to wander into a
   section under a forced answer).
5. A grammar the engine cannot build (an invalid schema, a schema feature it does not support) is a 400 naming
   the field that asked for it (`response_format` or `tools`).
"""
from __future__ import annotations

from typing import Any

from . import grammar as g
from . import reasoning
from .answers import AnswerPlan
from .api_errors import ApiError
from .schemas_tools import ResponseFormat, ToolChoice


def _body(plan: AnswerPlan, choice: ToolChoice, response_format: ResponseFormat | None) -> tuple[str | None, str]:
    """(grammar of the answer, the field it comes from), rules 1-3."""
    if choice.mode in ("required", "named") and plan.family is not None:
        tools = [{"name": t.name, "description": t.description, "parameters": t.parameters} for t in plan.tools]
        which = choice.name if choice.mode == "named" else "required"
        return g.tool_calls(plan.family, tools, which, choice.parallel), "tools"
    if response_format is None or response_format.type == "text":
        return None, "response_format"
    if response_format.type == "json_object":
        return g.json_object(), "response_format"
    spec = response_format.json_schema
    schema: dict[str, Any] = spec.schema_ if spec and spec.schema_ is not None else {"type": "object"}
    return g.json_schema(schema, strict=bool(spec and spec.strict)), "response_format"


def grammar_for(plan: AnswerPlan, choice: ToolChoice, response_format: ResponseFormat | None = None,
                thinking_budget: int | None = None) -> str | None:
    """The grammar the request's completion follows, or None (rules 1-5)."""
    param = "response_format"
    try:
        body, param = _body(plan, choice, response_format)
        if plan.reasoning and (plan.inside or thinking_budget is not None):
            return g.after_reasoning(body, opened=plan.inside, open_marker=reasoning.THINK_OPEN,
                                     close_marker=reasoning.THINK_CLOSE)
        return body
    except g.GrammarError as err:
        raise ApiError.bad_request(f"{param}: {err}", param=param) from None
