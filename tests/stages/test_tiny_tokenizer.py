"""The tiny tokenizer (stages/tiny_tokenizer.py), with transformers as the oracle of how a checkpoint's
tokenizer files are read."""
from __future__ import annotations

from stages.tiny_tokenizer import SPECIAL_TOKENS, special_ids


def test_tokenizer_loads_in_transformers_and_round_trips(tiny_model_factory):
    from transformers import AutoTokenizer

    d = tiny_model_factory("qwen3")
    tok = AutoTokenizer.from_pretrained(str(d))
    assert len(tok) == 512
    ids = special_ids()
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [509, 510, 511] == list(ids.values())
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", "<|endoftext|>")
    for text in ["Hello world, the river ran low.", "  two spaces\tand a tab\n", "東京 café 🙂 Straße ≤≥",
                 "def f(x):\n    return x + 1\n"]:
        enc = tok.encode(text, add_special_tokens=True)
        assert 509 not in enc and 510 not in enc  # nothing added around the text
        assert tok.decode(enc) == text
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == ids["<|im_start|>"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True).endswith(
        "<|im_start|>assistant\n<think>\n")
