"""A GGUF file's vocabulary as a `tokenizers.Tokenizer`, and its chat template and special tokens. No torch.

Only `tokenizer.ggml.model = "gpt2"` (byte-level BPE, as Llama 3, Qwen2 and Qwen3 ship) is built:
- the BPE model from `tokenizer.ggml.tokens` (id = position) and `tokenizer.ggml.merges` ("a b" pairs);
- added tokens from `tokenizer.ggml.token_type`: CONTROL ones are special (skipped by decode's
  skip_special), USER_DEFINED ones are plain added tokens; both are matched before the BPE runs, unnormalized;
- the pre-tokenizer from `tokenizer.ggml.pre` (PRE_TOKENIZER_SPLITS: the split regex of each known name, then
  byte-level without its own regex; "gpt-2" is byte-level's own GPT-2 regex); an unknown name is refused
  rather than guessed, since a different split gives different ids; the Qwen2 family also normalizes to NFC,
  as its Hugging Face tokenizer does;
- Llama 3's pre-tokenizer also takes a whole word found in the vocabulary as one token (ignore_merges), as
  both its Hugging Face tokenizer and llama.cpp do;
- a byte-level decoder; BOS prepended by the post-processor only when `tokenizer.ggml.add_bos_token` is true.
Special ids: bos/eos (and eot/eom, which also stop a request) from `tokenizer.ggml.*_token_id`; the chat
template from `tokenizer.chat_template`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from pool.gguf_meta import GGUFModel

# llama.cpp's token_type values (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "gpt-2": None, "gpt2": None,  # None: ByteLevel's own GPT-2 regex
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
IGNORE_MERGES_PRE = ("llama-bpe", "llama3")  # a whole word in the vocabulary is one token (Llama 3, both sides)
NFC_PRE = ("qwen2", "deepseek-r1-qwen")  # their Hugging Face tokenizers normalize to NFC first
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


class GGUFTokenizerError(ValueError):
    """The file's vocabulary cannot be built exactly; the message names the key."""


@dataclass
class GGUFVocab:
    """What the coordinator's Tokenizer needs from a GGUF file."""

    backend: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str]  # bos_token, eos_token, ... -> text
    eos_ids: set[int]


def build_tokenizer(model: GGUFModel) -> GGUFVocab:
    """The tokenizer of `model` (module docstring)."""
    path = model.path
    kind = model.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFTokenizerError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (only gpt2, byte-level BPE)")
    pre = model.field("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFTokenizerError(f"{path}: tokenizer.ggml.pre={pre!r} is not known; known: "
                                 f"{', '.join(PRE_TOKENIZER_SPLITS)}")
    tokens: list[str] = model.field("tokenizer.ggml.tokens") or []
    types: list[int] = model.field("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in model.field("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                   ignore_merges=pre in IGNORE_MERGES_PRE))
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in NFC_PRE:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    # Each keeps its id: every added token is in the vocabulary already.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED])

    def token(key: str) -> tuple[int | None, str | None]:
        i = model.field(f"tokenizer.ggml.{key}_token_id")
        return (int(i), tokens[int(i)]) if i is not None and 0 <= int(i) < len(tokens) else (None, None)

    bos_id, bos = token("bos")
    if model.field("tokenizer.ggml.add_bos_token") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, bos_id)])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    special = {f"{k}_token": text for k in ("bos", "eos", "unk", "pad", "sep") if (text := token(k)[1]) is not None}
    eos = {int(model.field(k)) for k in _EOS_KEYS if model.field(k) is not None}
    return GGUFVocab(backend, model.field("tokenizer.chat_template"), special, eos)


def read_vocab(path: str | Path) -> GGUFVocab:
    return build_tokenizer(GGUFModel(path))
