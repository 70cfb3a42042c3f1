"""The front's HTTP limits with real sockets: a request head past max_header_bytes is a 400 and the connection
is closed; a request that does not arrive whole within request_read_timeout_s is dropped, however slowly it
trickles in."""
from __future__ import annotations

import socket
import time

from tests.coordinator.fake_engine import running_front

HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_a_head_past_the_limit_is_refused_and_closed(tokenizer):
    with running_front(tokenizer, max_header_bytes=4096) as front:
        s = connect(front.url)
        try:
            s.sendall(HEAD + b"X-Pad: " + b"a" * 8192)  # never finished: more than the limit already
            answer = read_all(s)
        finally:
            s.close()
        assert answer.startswith(b"HTTP/1.1 400"), answer[:100]
        s = connect(front.url)
        s.sendall(HEAD + b"X-Pad: " + b"a" * 1000 + b"\r\n\r\n")  # within the limit: served
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.close()


def test_a_request_trickling_in_is_dropped_at_the_read_deadline(tokenizer):
    with running_front(tokenizer, request_read_timeout_s=1.0) as front:
        s = connect(front.url)
        t0 = time.monotonic()
        closed = False
        try:
            for i in range(40):  # one byte every 0.1 s: the keep-alive timer would be reset by each
                s.sendall(b"GET /health HTTP/1.1\r\nX-Slow: "[i % 10:i % 10 + 1] if i < 10 else b"a")
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            closed = True
        took = time.monotonic() - t0
        if not closed:
            s.settimeout(5)
            closed = read_all(s) == b""
        s.close()
        assert closed and took < 3.5, took
        s = connect(front.url)  # a whole request in time is served as ever
        s.sendall(HEAD + b"\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.close()


def test_a_half_closed_client_still_gets_its_answer(tokenizer):
    import json

    body = json.dumps({"model": "tiny-test", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
    with running_front(tokenizer) as front:
        s = connect(front.url)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        s.shutdown(socket.SHUT_WR)  # done sending, still reading
        answer = read_all(s)
        s.close()
        final = answer[answer.index(b"HTTP/1.1 200"):] if b"HTTP/1.1 200" in answer else answer
        assert final.startswith(b"HTTP/1.1 200") and b'"chat.completion"' in final, answer[:300]
        assert answer.startswith((b"HTTP/1.1 102", b"HTTP/1.1 200")), answer[:100]
