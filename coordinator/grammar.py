"""Constrained decoding: grammars (llguidance) and the per-request matcher that masks each sampled token.

A request may carry a grammar (`GenRequest.grammar`); every token sampled for it is then one the grammar
allows. The coordinator keeps one `Matcher` per such request; for each step that samples the request, the
matcher's bitmask travels in the step header and the last stage applies it to that slot's logits
(stages/grammar_mask.py, stages/sampling.py); the sampled token then advances the matcher.

    API: response_format / tool_choice          constraints.py -> json_object(), json_schema(), tool_calls(),
         (coordinator/constraints.py)                             after_reasoning()  -> grammar str | GrammarError
    GenRequest(..., grammar=g)                  scheduler: Matcher(GrammarTokenizer, g, banned) in generate()
    step header {"masks": {slot: mask}}         last stage: logits[row][~mask] = -inf, then sampling
    RESULT token                                matcher.advance(token), next mask

Rules:
1. A grammar is llguidance's serialized form (JSON text `{"grammars": [...]}`), built by the constructors here
   and validated on the spot without a tokenizer; a schema or tool list that cannot become a grammar raises
   GrammarError, whose message the API answers with a 400 naming the field it came from.
2. JSON is compact: the only whitespace between JSON tokens is the fixed separators ", " and ": " (llguidance's
   `whitespace_flexible` off). A model, least of all a random one, cannot pad an answer with an endless run of
   spaces or newlines; string contents stay free.
3. `json_schema(schema, strict=True)` refuses a schema keyword llguidance cannot enforce; `strict=False`
   enforces what it can and ignores the rest (llguidance's `lenient`). Tool parameter schemas are strict. A
   schema carrying "x-guidance" is refused: those are this engine's options, not part of a JSON schema.
4. Tool calls (`tool_calls`), exactly as the tool-call parser (tool_parsers.py) reads them, <obj> being an
   object that follows that tool's `parameters` schema (a tool without one takes `{}`):
      hermes       <tool_call>\\n{"name": "<name>", "arguments": <obj>}\\n</tool_call>   blocks joined by "\\n"
      llama3_json  {"name": "<name>", "parameters": <obj>}                            calls joined by "; "
      mistral      [TOOL_CALLS][{"name": "<name>", "arguments": <obj>}, ...]           one list, ", " between
   `choice` "required": any of the tools; a tool name: that tool only. `parallel` False: exactly one call,
   True: one or more. The name is written as a JSON string. Markers ("<tool_call>", "[TOOL_CALLS]") are text,
   never a special token, so the decoded text carries them whether or not decoding skips special tokens.
5. A reasoning model (`after_reasoning`): the thinking section runs free until its close marker, and the answer
   after it follows `body` (or is free text when `body` is None). A token budget on the section is the
   Matcher's (`Matcher(..., budget=)`, coordinator/thinking_budget.py): at the budget it forces the marker.
   `opened`: the prompt already opened the section; otherwise the completion may open one at its very start.
   At most two newlines separate the close marker from the answer.
6. `GrammarTokenizer.for_tokenizer(tok, n_vocab)` wraps the coordinator's tokenizer for llguidance, once per
   (tokenizer, n_vocab) (building it takes ~1 s for a large vocabulary). `n_vocab` is the model's vocabulary
   (its lm_head rows, the last stage's HELLO "vocab"), which may be larger than the tokenizer's: ids past the
   tokenizer are never allowed. A model smaller than its tokenizer, or a tokenizer without an eos id, is refused.
7. Mask layout (what `Matcher.mask()` returns and the step header carries), W = ceil(n_vocab / 32) words:

        bytes   0   1   2   3 | 4   5   6   7 | ... | 4W-4 .. 4W-1
        word    0 (int32 LE)  | 1             | ... | W-1
        token 32*w + i is allowed  <=>  bit i of word w (value 1 << i) is set;  bits past n_vocab are 0

8. `Matcher(gt, grammar, banned)`: one per request. `mask()` is the next token's allowed set; `advance(token)`
   takes the sampled token (a token the grammar refuses is a GrammarError); `finished` once the grammar has
   accepted and allows nothing more: its mask then holds only the eos ids, so the request ends with "stop".
   `banned` (the request's logit_bias -100 ids) is cleared from every mask, so a ban and a grammar never
   leave the sampler an empty row: a mask left with no token is a GrammarError for that request alone.
9. llguidance drops the GIL in `Matcher()` and `mask()`: the scheduler runs them in worker threads, one call
   per matcher at a time (a matcher is never used by two threads at once).
"""
from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import llguidance

from .reasoning import THINK_CLOSE, THINK_OPEN
from .thinking_budget import BudgetCounter, SectionBudget

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

FAMILIES = ("hermes", "llama3_json", "mistral")
ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "
_COMPACT = {"whitespace_flexible": False, "item_separator": ITEM_SEPARATOR, "key_separator": KEY_SEPARATOR}
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "additionalProperties": False}
BAN_BIAS = 100  # a logit_bias of -BAN_BIAS bans its token (stages/sampling.py)
_MAX_GAP_NEWLINES = 2  # rule 5: "</think>\n\n" as templates write it


class GrammarError(ValueError):
    """A grammar that cannot be built, or a request it cannot serve; the message says which part and why."""


# ---- constructors (rules 1-5) ----------------------------------------------------------------------------
def _checked(grammar: str) -> str:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(messages[0] if messages else "the grammar is invalid")
    return grammar


def _schema_with_options(schema: Any, lenient: bool, what: str) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON schema object, got {type(schema).__name__}")
    if "x-guidance" in schema:
        raise GrammarError(f"{what}: 'x-guidance' is an engine option, not part of a JSON schema")
    return {**schema, "x-guidance": {**_COMPACT, "lenient": lenient}}


def _schema_grammar(schema: dict[str, Any], what: str) -> str:
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise GrammarError(f"{what} is not JSON: {err}") from None
    try:
        return _checked(llguidance.LLMatcher.grammar_from_json_schema(text))
    except GrammarError as err:
        raise GrammarError(f"{what}: {err}") from None


def json_object() -> str:
    """Any JSON object, compact (rule 2)."""
    return _schema_grammar(_schema_with_options({"type": "object"}, False, "schema"), "schema")


def json_schema(schema: dict[str, Any], strict: bool) -> str:
    """A JSON value following `schema`, compact; `strict` as rule 3."""
    return _schema_grammar(_schema_with_options(schema, not strict, "schema"), "schema")


def _lark(lark: str) -> str:
    """A lark grammar in the serialized form of rule 1 (llguidance takes lark text or this JSON)."""
    return json.dumps({"grammars": [{"lark_grammar": lark}]}, ensure_ascii=False)


def _lit(text: str) -> str:
    """A lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)


def _regex_literal(text: str) -> str:
    """`text` as a regex (for a lark /.../ terminal) matching it exactly: every non-alphanumeric char escaped."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _tool_list(tools: Any) -> list[tuple[str, dict[str, Any]]]:
    if not isinstance(tools, list) or not tools:
        raise GrammarError("tools must be a non-empty list")
    out: list[tuple[str, dict[str, Any]]] = []
    for i, tool in enumerate(tools):
        name = tool.get("name") if isinstance(tool, dict) else None
        if not isinstance(name, str) or not name:
            raise GrammarError(f"tools[{i}] needs a non-empty string 'name'")
        if any(name == n for n, _ in out):
            raise GrammarError(f"tools[{i}]: the name {name!r} is used by an earlier tool")
        params = tool.get("parameters")
        what = f"tools[{i}] ({name}).parameters"
        out.append((name, _schema_with_options(_NO_PARAMETERS if params is None else params, False, what)))
    return out


def tool_calls(family: str, tools: list[dict[str, Any]], choice: str, parallel: bool) -> str:
    """Calls of `tools` in `family`'s format (rule 4); `choice` "required" or a tool's name."""
    if family not in FAMILIES:
        raise GrammarError(f"tool-call family {family!r} is not one of {', '.join(FAMILIES)}")
    listed = _tool_list(tools)
    if choice != "required":
        listed = [(n, p) for n, p in listed if n == choice]
        if not listed:
            raise GrammarError(f"tool_choice names {choice!r}, which is not among the tools")
    args_key = "parameters" if family == "llama3_json" else "arguments"
    rules = []
    for i, (name, params) in enumerate(listed):
        head = "{" + f'"name"{KEY_SEPARATOR}{json.dumps(name, ensure_ascii=False)}{ITEM_SEPARATOR}"{args_key}"{KEY_SEPARATOR}'
        rules.append(f"tool_{i}: {_lit(head)} args_{i} \"}}\"")
        rules.append(f"args_{i}: %json {json.dumps(params, ensure_ascii=False)}")
    call = " | ".join(f"tool_{i}" for i in range(len(listed)))
    many = {"hermes": "\n", "llama3_json": "; ", "mistral": ITEM_SEPARATOR}[family]
    calls = f"call ({_lit(many)} call)*" if parallel else "call"
    if family == "hermes":
        top = [f"start: {calls}", f"call: {_lit('<tool_call>' + chr(10))} one {_lit(chr(10) + '</tool_call>')}"]
    elif family == "llama3_json":
        top = [f"start: {calls}", "call: one"]
    else:
        top = [f"start: {_lit('[TOOL_CALLS][')} {calls} \"]\"", "call: one"]
    lark = "\n".join([*top, f"one: {call}", *rules]) + "\n"
    try:
        return _checked(_lark(lark))
    except GrammarError as err:
        raise GrammarError(f"tools: {err}") from None


def after_reasoning(body: str | None, opened: bool, open_marker: str, close_marker: str) -> str:
    """A thinking section that runs until the model closes it, then `body` (rule 5; a budget is the
    Matcher's, coordinator/thinking_budget.py)."""
    if not open_marker or not close_marker:
        raise GrammarError("the thinking markers must be non-empty")
    anything = "/(?s:.*)/"
    close = _regex_literal(close_marker)
    # The section is one lexeme that ends with the first close marker. llguidance's lexer does not back up: a
    # lexeme that may hold "</think" but not "</think>" could not hand the ">" to a separate marker lexeme.
    lines = [f"CLOSED: /(?s:.*){close}/ & ~/(?s:.*){close}(?s:.+)/",
             f"GAP: /\\n{{1,{_MAX_GAP_NEWLINES}}}/"]
    head = "" if opened else f"{_lit(open_marker)} "
    section = f"{head}CLOSED GAP? answer"
    if opened:
        lines.insert(0, f"start: {section}")
        text = anything
    else:
        lines.insert(0, f"start: {section} | answer")
        text = f"{anything} & ~/[ \\t\\r\\n]*{_regex_literal(open_marker)}(?s:.*)/"  # the section opens only first
    grammars: list[dict[str, Any]] = []
    if body is None:
        lines.append(f"answer: TEXT\nTEXT: {text}")
    else:
        try:
            grammars = json.loads(body)["grammars"]
            grammars[0]["name"] = "answer"
        except (ValueError, TypeError, KeyError, IndexError):
            raise GrammarError("the answer's grammar is not one of this module's grammars") from None
        lines.append("answer: @answer")
    lark = "\n".join(lines) + "\n"
    return _checked(json.dumps({"grammars": [{"lark_grammar": lark}, *grammars]}, ensure_ascii=False))


# ---- the tokenizer and the matcher (rules 6-9) -------------------------------------------------------
class GrammarTokenizer:
    """The coordinator's tokenizer as llguidance sees it, over the model's `n_vocab` ids (rule 6)."""

    _cache: "weakref.WeakKeyDictionary[Any, dict[int, GrammarTokenizer]]" = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer_json: str, tokenizer_vocab: int, n_vocab: int, eos_ids: Iterable[int]) -> None:
        eos = sorted(set(eos_ids))
        if n_vocab < tokenizer_vocab:
            raise GrammarError(f"the model's vocabulary ({n_vocab} ids) is smaller than its tokenizer's "
                               f"({tokenizer_vocab} tokens)")
        if not eos:
            raise GrammarError("the tokenizer names no eos token, so a constrained request could never end")
        if eos[0] < 0 or eos[-1] >= tokenizer_vocab:
            raise GrammarError(f"eos ids {eos} are not all in the tokenizer's vocabulary [0, {tokenizer_vocab})")
        self.n_vocab = n_vocab
        self.words = (n_vocab + 31) // 32
        self.eos_ids = tuple(eos)
        self.ll = llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos)

    @classmethod
    def for_tokenizer(cls, tok: "Tokenizer", n_vocab: int) -> "GrammarTokenizer":
        """The one GrammarTokenizer of (`tok`, `n_vocab`), built on first use."""
        with cls._lock:
            built = cls._cache.setdefault(tok, {})
            if n_vocab not in built:
                built[n_vocab] = cls(tok.backend.to_str(), tok.vocab_size, n_vocab, tok.eos_ids)
            return built[n_vocab]

    def budget(self, thinking: SectionBudget, tok: "Tokenizer") -> BudgetCounter:
        """A counter of `thinking` over this tokenizer (coordinator/thinking_budget.py)."""
        return BudgetCounter(thinking, THINK_OPEN, THINK_CLOSE, tok.encode, self.ll.decode_bytes)


class Matcher:
    """One request's position in its grammar (rule 8)."""

    def __init__(self, gt: GrammarTokenizer, grammar: str, banned: Iterable[int] = (),
                 budget: BudgetCounter | None = None) -> None:
        if not isinstance(grammar, str) or not grammar:
            raise GrammarError("the grammar must be a non-empty string")
        self.gt = gt
        self.budget = budget
        self._m = llguidance.LLMatcher(gt.ll, grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"the grammar is invalid: {self._m.get_error()}")
        keep = (1 << (32 * gt.words)) - 1
        for token in banned:
            if 0 <= token < gt.n_vocab:
                keep &= ~(1 << token)
        self._keep = None if keep == (1 << (32 * gt.words)) - 1 else keep  # None: nothing banned

    @classmethod
    def for_request(cls, tok: "Tokenizer | None", n_vocab: Any, grammar: str,
                    logit_bias: list[list[float]] | None, thinking: SectionBudget | None = None) -> "Matcher":
        """The Matcher of a GenRequest: its grammar over `tok` and the model's `n_vocab` ids, with the ids its
        logit_bias bans (bias -100) cleared from every mask (rule 8), and its thinking budget."""
        if tok is None:
            raise GrammarError("this engine has no tokenizer to match a grammar against")
        if isinstance(n_vocab, bool) or not isinstance(n_vocab, int) or n_vocab <= 0:
            raise GrammarError(f"the model's vocabulary size is unknown (the last stage reported {n_vocab!r})")
        banned = [int(t) for t, b in (logit_bias or []) if b <= -BAN_BIAS]
        gt = GrammarTokenizer.for_tokenizer(tok, n_vocab)
        return cls(gt, grammar, banned, gt.budget(thinking, tok) if thinking is not None else None)

    def mask(self) -> bytes:
        """The next token's allowed set, laid out as rule 7 (GrammarError when none is left): one id when the
        thinking budget forces it."""
        mask = self._m.compute_bitmask()[: 4 * self.gt.words]  # llguidance adds a word when 32 divides n_vocab
        if self._m.is_error():
            raise GrammarError(f"the grammar failed: {self._m.get_error()}")
        forced = self.budget.forced() if self.budget is not None else None
        if forced is not None:
            if mask[forced // 8] >> (forced % 8) & 1:
                return (1 << forced).to_bytes(len(mask), "little")
            if self.budget.forcing:
                raise GrammarError(f"the grammar does not allow the thinking section's close marker (id {forced})")
            # the section ends inside a UTF-8 character: the grammar lets only its next bytes come first
        if self._keep is not None:
            mask = (int.from_bytes(mask, "little") & self._keep).to_bytes(len(mask), "little")
        if mask.count(0) == len(mask):
            raise GrammarError("logit_bias bans every token the grammar allows next" if self._keep is not None
                               else "the grammar allows no token next")
        return mask

    def advance(self, token: int) -> None:
        """Take the sampled `token`; GrammarError if the grammar does not allow it here."""
        if self.budget is not None:
            try:
                self.budget.advance(token)
            except ValueError as err:
                raise GrammarError(str(err)) from None
        if not self._m.consume_token(token):
            raise GrammarError(f"token {token} is not allowed by the grammar here: {self._m.get_error()}")

    def advance_and_mask(self, token: int) -> bytes:
        """`advance(token)`, then the mask after it: the two calls a worker thread makes per sampled token."""
        self.advance(token)
        return self.mask()

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more than an eos id."""
        return self._m.is_stopped() and not self._m.is_error()
