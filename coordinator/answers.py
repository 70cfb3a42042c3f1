"""What a chat completion's text becomes for the client: reasoning, answer text and tool calls.

    text deltas -> ThinkSplitter (reasoning.py) -> answer text -> StreamParser (tool_parsers.py) -> events

Rules:
1. `AnswerPlan` is decided once per request from the model's chat template and the request: whether the text
   has a reasoning section (reasoning.py rules 1-2), and whether tool calls are parsed out of the answer (the
   request has tools and its tool_choice is not "none"; the format is the template's family,
   `tool_parsers.family_for_template`). Tools on a model whose template renders none are a 400 naming `tools`.
2. Events: Reasoning(text), Text(text), CallStart(index, id, name), CallArgs(index, text), CallEnd(index).
   The call ids are made here, one per call (`call_...` for OpenAI, `toolu_...` for Anthropic), so a stream and
   the final message name a call the same way.
3. `shape(text)` (whole answers) and `AnswerShaper.feed` / `finish` (streams) give the same reasoning, text and
   calls for the same completion text, whatever its cut into deltas (both parsers keep that rule).
4. A request whose answer holds tool calls finishes with "tool_calls" (OpenAI) / "tool_use" (Anthropic) when the
   model ended its turn; a length stop stays a length stop.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from . import reasoning
from . import tool_parsers as tp
from .schemas_tools import ToolChoice, ToolSpec


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


CallArgs, CallEnd = tp.CallArgs, tp.CallEnd  # the parser's own events pass through unchanged


Event = Reasoning | Text | CallStart | CallArgs | CallEnd


class PlanError(ValueError):
    """The request asks for what this model's template cannot do; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class AnswerPlan:
    reasoning: bool = False  # the completion may hold a reasoning section
    inside: bool = False  # ... and starts inside it (the prompt opened it)
    family: str | None = None  # tool calls parsed in this format; None: no parsing
    tools: tuple[ToolSpec, ...] = ()
    id_prefix: str = "call_"

    @property
    def tool_names(self) -> set[str]:
        return {t.name for t in self.tools}


def plan_for(chat_template: str | None, prompt_text: str, tools: list[ToolSpec], choice: ToolChoice,
             id_prefix: str = "call_") -> AnswerPlan:
    thinks = reasoning.template_thinks(chat_template) and not reasoning.prompt_closes_thinking(prompt_text)
    family = None
    if tools:
        family = tp.family_for_template(chat_template)
        if family is None:
            raise PlanError("this model's chat template renders no tools, so it cannot be given any", "tools")
    return AnswerPlan(thinks, thinks and reasoning.prompt_opens_thinking(prompt_text),
                      family if choice.mode != "none" else None, tuple(tools), id_prefix)


def new_call_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass
class Shaped:
    """A whole answer: reasoning (None when the model has no section), text, calls as (id, ToolCall)."""

    reasoning: str | None
    text: str
    calls: list[tuple[str, tp.ToolCall]] = field(default_factory=list)


def shape(plan: AnswerPlan, text: str) -> Shaped:
    thought, answer = reasoning.split(text, plan.inside) if plan.reasoning else (None, text)
    if plan.family is None:
        return Shaped(thought, answer)
    content, calls = tp.parse(plan.family, answer, plan.tool_names)
    return Shaped(thought, content, [(new_call_id(plan.id_prefix), c) for c in calls])


class AnswerShaper:
    """Stream form of `shape` (rule 3)."""

    def __init__(self, plan: AnswerPlan) -> None:
        self.plan = plan
        self._think = reasoning.ThinkSplitter(plan.inside) if plan.reasoning else None
        self._tools = tp.StreamParser(plan.family, plan.tool_names) if plan.family else None
        self.calls = 0  # CallStart events given out so far; both routes' stop reasons read it

    def feed(self, text: str) -> list[Event]:
        if self._think is None:
            return self._answer(text)
        thought, answer = self._think.feed(text)
        return ([Reasoning(thought)] if thought else []) + self._answer(answer)

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._think is not None:
            thought, answer = self._think.flush()
            out += ([Reasoning(thought)] if thought else []) + self._answer(answer)
        if self._tools is not None:
            out += self._convert(self._tools.finish())
        return out

    def _answer(self, text: str) -> list[Event]:
        if not text:
            return []
        if self._tools is None:
            return [Text(text)]
        return self._convert(self._tools.feed(text))

    def _convert(self, events: list) -> list[Event]:
        out: list[Event] = []
        for e in events:
            if isinstance(e, tp.Content):
                if e.text:
                    out.append(Text(e.text))
            elif isinstance(e, tp.CallStart):
                self.calls += 1
                out.append(CallStart(e.index, new_call_id(self.plan.id_prefix), e.name))
            elif isinstance(e, tp.CallArgs):
                if e.text:
                    out.append(e)
            elif isinstance(e, tp.CallEnd):
                out.append(e)
        return out
