"""The coordinator's tokenizer: encode/decode, the chat template, streaming text out of token ids.

No torch: `tokenizers` for the vocabulary, jinja2 for the chat template. A checkpoint directory must hold
a `tokenizer.json` (a "fast" tokenizer); the template comes from `chat_template.jinja`,
`chat_template.json` or `tokenizer_config.json` (first found, as transformers reads them). A .gguf file
carries its own vocabulary and template (`Tokenizer.from_gguf`, coordinator/gguf_tokenizer.py).

Templates are rendered the way transformers renders them, so a prompt here is the prompt the model was
trained on: an immutable sandboxed jinja2 environment with trim_blocks and lstrip_blocks, the loopcontrols
extension, a `{% generation %}` block that just renders its body, `raise_exception`, `strftime_now`, a
`tojson` that does not escape HTML, and the special tokens (`bos_token`, `eos_token`, ...) as variables.
Message keys whose value is None are dropped first (transformers does the same; templates test for a
missing key, not for None). Content given as a list of `{"type": "text", "text": ...}` parts is joined
with "\\n" into one string (other part types are refused: this engine serves text).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or a message is malformed): a client error."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it only
    renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _find_template(d: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(d / "chat_template.json").get("chat_template") or tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates expect them: None-valued keys dropped, text parts joined with "\\n"."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
        m = {k: v for k, v in message.items() if v is not None}
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ChatTemplateError(f"messages[{i}].content: only text parts are supported, got {kind!r}")
                texts.append(part["text"])
            m["content"] = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts")
        out.append(m)
    return out


class Tokenizer:
    """A checkpoint's tokenizer and chat template; build it with `Tokenizer.from_dir`."""

    def __init__(self, backend: _Backend, chat_template: str | None, special_tokens: Mapping[str, str],
                 eos_ids: Iterable[int], name: str) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)  # e.g. {"eos_token": "<|im_end|>", ...}
        self.eos_ids = frozenset(eos_ids)
        self.name = name
        self._template = compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, dir: str | Path) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json, the chat template, and every eos id named by
        generation_config.json, config.json and the tokenizer's eos_token (all of them stop a request)."""
        d = Path(dir)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {d} (only fast tokenizers are supported)")
        backend = _Backend.from_file(str(d / "tokenizer.json"))
        cfg = _read_json(d / "tokenizer_config.json")
        special = {k: t for k in SPECIAL_TOKEN_NAMES if (t := _token_text(cfg.get(k))) is not None}
        eos = _ids(_read_json(d / "generation_config.json").get("eos_token_id"))
        eos |= _ids(_read_json(d / "config.json").get("eos_token_id"))
        if "eos_token" in special and backend.token_to_id(special["eos_token"]) is not None:
            eos.add(backend.token_to_id(special["eos_token"]))
        return cls(backend, _find_template(d, cfg), special, eos, d.resolve().name)

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """The vocabulary, chat template and special ids of a .gguf file (coordinator/gguf_tokenizer.py)."""
        from .gguf_tokenizer import read_vocab

        v = read_vocab(path)
        return cls(v.backend, v.chat_template, v.special_tokens, v.eos_ids, Path(path).stem)

    @property
    def vocab_size(self) -> int:
        """Token ids this tokenizer knows, added tokens included (the model's vocab may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`; add_special adds what the tokenizer's post-processor adds (e.g. BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages`, rendered as transformers renders it (extra template variables,
        e.g. `enable_thinking`, go in kwargs). Raises ChatTemplateError for a client mistake."""
        if self._template is None:
            raise ChatTemplateError(f"the tokenizer of {self.name} has no chat template")
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=normalize_messages(messages), tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:  # raise_exception, undefined names, sandbox refusals
            raise ChatTemplateError(f"chat template: {e}") from e

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                 tools: list[dict] | None = None, **kwargs: Any) -> list[int]:
        """Token ids of the rendered prompt. The template already writes every special token it wants
        (BOS included), so nothing is added around it (transformers does the same)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs))


class IncrementalDetokenizer:
    """Turns generated ids into text as they arrive, emitting only complete characters.

    The prefix-offset technique: decode a short window of ids twice, without and with the new ids, and
    emit the difference. The window starts a few tokens back so that decoders which depend on the
    previous token (SentencePiece's leading space) see it; text is held while it ends in U+FFFD (half of
    a multi-byte character), and `flush` gives whatever is left at the end. The concatenation of all
    outputs equals `decode(generated ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special: bool = True) -> None:
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.ids = list(prompt_ids or [])[-6:]  # context only: never emitted
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - 5, 0)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special=self.skip_special)

    def push(self, token: int) -> str:
        """Add one generated id; return the text it completes (often "")."""
        self.ids.append(token)
        prefix = self._decode(self.prefix_offset, self.read_offset)
        text = self._decode(self.prefix_offset)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """The held tail (an incomplete character decodes as U+FFFD); the detokenizer is then drained."""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        text = self._decode(self.prefix_offset)
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]


class StopStrings:
    """Cuts streamed text at the first stop string, never emitting any part of it.

    `feed(text)` returns (emit, stopped). Text that could still grow into a stop string (a tail of the
    stream equal to the start of some stop) is held back until it cannot; `flush()` returns it when the
    stream ends without a stop. The first stop string to be completed wins (earliest end in the stream;
    on a tie the longer one), as if the text arrived one character at a time; the output ends right
    before it. After a stop every feed returns ("", True).
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = [s for s in stops]
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stopped = False
        self.matched: str | None = None
        self._held = ""
        self._longest = max((len(s) for s in self.stops), default=0)

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            start = buf.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is not None:
            self.stopped, self.matched, self._held = True, best[2], ""
            return buf[:best[1]], True
        keep = 0
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            if any(stop.startswith(buf[-k:]) for stop in self.stops):
                keep = k
                break
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """The held tail when the stream ends without a stop ("" after a stop)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
