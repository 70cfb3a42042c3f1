"""A prompt that cannot fit max_context is refused before it is tokenized, so it costs the front its bytes, not
~150 bytes per token: measured in a fresh process (its peak RSS), with the HTTP front on a fake engine and the
real tiny tokenizer, for a 6 MB chat and 8 concurrent count_tokens of it (a count may go 4 contexts long: this
is far more)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = r'''
import json, resource, sys, threading
import httpx
from coordinator.tokenizer import Tokenizer
from tests.coordinator.fake_engine import running_front

tok = Tokenizer.from_dir(sys.argv[1])
text = "lorem ipsum dolor sit amet " * (6_000_000 // 27)
with running_front(tok, max_context=4096, max_body_bytes=8 << 20) as front:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = httpx.post(front.url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny-test", "messages": [{"role": "user", "content": text}], "max_tokens": 4})
    answers = [r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]]
    out = []
    def count():
        out.append(httpx.post(front.url + "/v1/messages/count_tokens", timeout=60,
                              json={"model": "tiny-test", "messages": [{"role": "user", "content": text}]}).status_code)
    threads = [threading.Thread(target=count) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"answers": answers, "counts": out, "grew_mib": (peak - base) / 1024}))
'''


def test_an_oversized_prompt_is_refused_before_tokenizing(tiny_model_factory):
    out = subprocess.run([sys.executable, "-c", PROBE, str(tiny_model_factory())], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["answers"] == [400, "context_length_exceeded", "messages"], got
    assert got["counts"] == [400] * 8, got
    assert got["grew_mib"] < 400, got  # tokenizing it would be ~1 GB per copy


def test_count_tokens_counts_past_the_context_but_not_without_bound(tokenizer):
    import httpx

    from coordinator.api_generation import COUNT_CONTEXTS
    from tests.coordinator.fake_engine import running_front

    with running_front(tokenizer, max_context=64) as front:
        limit = 64 * front.app.state.front.max_token_chars
        ask = lambda text: httpx.post(front.url + "/v1/messages/count_tokens", timeout=30, json={  # noqa: E731
            "model": "tiny-test", "messages": [{"role": "user", "content": text}]})
        past = ask("word " * (limit // 5 + 10))  # past one context: still counted
        assert past.status_code == 200 and past.json()["input_tokens"] > 64, past.text
        far = ask("x" * (COUNT_CONTEXTS * limit + 1))
        assert far.status_code == 400 and "cannot fit" in far.text, far.text
        chat = httpx.post(front.url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny-test", "messages": [{"role": "user", "content": "x" * (limit + 1)}]})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded", chat.text
