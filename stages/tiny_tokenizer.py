"""The tiny model's tokenizer: a byte-level BPE trained on `CORPUS`, its special tokens and its ChatML template.

stages/tiny.py writes it into every tiny checkpoint (`tokenizer.json`, `tokenizer_config.json`); the text
here is part of the checkpoint format, and `ensure_tiny`'s cache key covers this file.

Rules:
- Deterministic: training on `CORPUS` gives the same tokenizer every time.
- Byte-level BPE trained to TOKENIZER_VOCAB - 3 tokens, then the three special tokens `<|endoftext|>`,
  `<|im_start|>`, `<|im_end|>` appended (the last ids, as in Qwen). No normalizer, so
  decode(encode(text)) == text for any text. Nothing is added around an encoded text (no BOS).
"""
from __future__ import annotations

from typing import Any

# tokenizers is imported where the tokenizer is trained, so that a cache hit in ensure_tiny stays cheap.

TOKENIZER_VOCAB = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|im_end|>", "<|endoftext|>"

# ChatML with tools and a thinking section, as Qwen3 writes it: a first system message (or the tools block)
# opens the prompt; an assistant's tool calls are <tool_call> blocks of {"name", "arguments"} JSON; tool results
# are <tool_response> blocks inside one user turn; `enable_thinking` true opens a <think> section after the
# generation prompt, false writes an empty one, and left out it writes neither (the tiny model thinks only when asked); an earlier assistant turn's
# reasoning is dropped, as Qwen3 drops it before the last user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}\n"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}\n"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}\n"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "{{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "{%- endif %}\n"
    "{%- if message.role == 'system' and loop.first and tools %}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{{- '<|im_start|>assistant\\n' + (message.content | default('', true)) }}\n"
    "{%- for call in message.tool_calls | default([]) %}\n"
    "{%- set fn = call.function if call.function is defined else call %}\n"
    "{%- if loop.first and message.content or not loop.first %}{{- '\\n' }}{%- endif %}\n"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}\n"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}\n"
    "{{- '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'tool' %}\n"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}\n"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] | default('', true)) + "
    "'<|im_end|>' + '\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}\n"
    "{%- elif enable_thinking is defined %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n"
    "{%- endif %}\n"
)

# The tokenizer's training text: part of the format (see the module docstring).
CORPUS: tuple[str, ...] = (
    """The river ran low that summer, and the children of the village walked along its stony bed
looking for things the water had kept. They found a green bottle, a key with no door, and a wheel
from a cart that nobody remembered. Each evening they brought their finds to the old mill and laid
them out on the long table, and the miller, who said very little, wrote every one of them into a
book with a brown cover.""",
    """A server that answers many people at once must decide, many times a second, whose words to
read next. It keeps a small number of lanes open; when a lane becomes free, the next request in the
queue takes it. Memory is the scarce thing: every token a conversation has seen leaves a trace that
must be kept until the conversation ends, and the traces of long conversations are large.""",
    """Good tests are small and honest. They build the smallest world in which a rule can break,
break it on purpose, and check that the program notices. A test that cannot fail tells you nothing;
a test that fails for the wrong reason tells you something false. Write the expected numbers down,
exactly, and let the machine compare them.""",
    """def chunks_needed(cells: int, chunk_cells: int) -> int:
    \"\"\"Return how many chunks hold `cells` cells.\"\"\"
    return (cells + chunk_cells - 1) // chunk_cells


class FreeList:
    def __init__(self, n: int) -> None:
        self.free = list(range(n))

    def take(self) -> int | None:
        return self.free.pop(0) if self.free else None

for i in range(10):
    print(f"step {i}: {chunks_needed(i * 100, 64)} chunks")
""",
    """#include <stdio.h>
static int sum(const int *xs, size_t n) {
    int total = 0;
    for (size_t i = 0; i < n; ++i) total += xs[i];
    return total;
}
int main(void) { int v[4] = {1, 2, 3, 4}; printf("%d\\n", sum(v, 4)); return 0; }
""",
    """{"model": "tiny", "messages": [{"role": "system", "content": "You are helpful."},
{"role": "user", "content": "What is the capital of France?"}], "stream": true}
SELECT name, count(*) FROM requests WHERE status = 'done' GROUP BY name LIMIT 10;
$ git commit -m "Fix the off-by-one in shrink" && git push origin main""",
    """Café au lait, crème brûlée, naïve façade, über, Straße, mañana, smörgåsbord, jalapeño.
Tokyo is 東京 and Kyoto is 京都; 日本語の文章も少し入れておく。 Москва и Санкт-Петербург.
Ελληνικά γράμματα: α β γ δ. Emoji: 🙂 🚀 ✨ — and a few symbols: € £ ¥ © ° ± × ÷ → ≤ ≥.""",
    """Questions and answers. Q: How many legs does a spider have? A: Eight. Q: What colour is the
sky on a clear day? A: Blue. Q: Which number comes after forty-one? A: Forty-two. Q: Who wrote the
letter? A: Nobody knows; it was signed only with a drawing of a small boat.""",
)


def build_tokenizer() -> "tokenizers.Tokenizer":  # noqa: F821 (imported lazily)
    """Train the tiny byte-level BPE tokenizer on CORPUS; same result every time."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.get_vocab_size() != TOKENIZER_VOCAB:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected {TOKENIZER_VOCAB}")
    return tok


def special_ids() -> dict[str, int]:
    """Ids of the special tokens: appended after the trained vocabulary, in SPECIAL_TOKENS order."""
    first = TOKENIZER_VOCAB - len(SPECIAL_TOKENS)
    return {t: first + i for i, t in enumerate(SPECIAL_TOKENS)}


def tokenizer_config(max_position: int) -> dict[str, Any]:
    """The `tokenizer_config.json` of a tiny checkpoint: the special tokens, the ChatML template, nothing
    added around an encoded text."""
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for t, i in special_ids().items()}
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)],
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": max_position,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
