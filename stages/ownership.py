"""Which coordinator a stage serves: one box, one owner (run by the stage's I/O thread; no torch).

Rules:
- A HELLO is accepted only with `box` = HMAC(box key, "hello:<session>") (pool/runtime.py `token`): proof that
  the coordinator belongs to this box, without sending the key. A wrong or missing one is refused with
  `{"hello_refused": true, "owned": false, "message"}` and changes nothing.
- The stage's owner is the ZeroMQ identity of the last accepted HELLO, with its session. While the owner is
  alive (heard from within `alive_s`, the coordinators' stage_timeout: a live coordinator pings far more often),
  a HELLO of another session is refused with `"owned": true`, naming the owner's session and how long ago it
  was heard; the coordinator that gets it prints it and exits (after waiting out `alive_s` once, so a
  restarted coordinator whose predecessor died a moment ago is not refused for good). The same session may
  re-HELLO from a new socket (the link reopens one after marking a stage down): that moves the owner.
- A BYE from the owner ends its ownership at once (a clean coordinator exit). Everything else (OPS, STEP, SAVE,
  LOAD, PING, BYE) from any identity but the owner's is dropped with a log line: a peer that has not proved it
  belongs to the box gets nothing and changes nothing.
- A HIDDEN (stage to stage) carries `box` = HMAC(box key, "hidden"); one without it is dropped.
"""
from __future__ import annotations

from pool.runtime import same_token, token


class Ownership:
    """The owner of one stage and the checks above."""

    def __init__(self, key: bytes, stage: int, alive_s: float) -> None:
        self.key, self.stage, self.alive_s = key, stage, alive_s
        self.hidden_token = token(key, "hidden")
        self.ident: bytes | None = None
        self.session: str | None = None
        self.seen = 0.0

    def hello(self, ident: bytes, header: dict, now: float) -> dict | None:
        """None when the HELLO is accepted (and `ident` is the owner now); else the refusal to send back."""
        session = header.get("session")
        if not isinstance(session, str) or not same_token(header.get("box"), token(self.key, f"hello:{session}")):
            return {"hello_refused": True, "owned": False,
                    "message": f"stage {self.stage} refused the HELLO: its box key does not match this stage's "
                               f"(box.key_file); a coordinator of another box cannot drive this stage"}
        if self.ident is not None and session != self.session and now - self.seen < self.alive_s:
            return {"hello_refused": True, "owned": True,
                    "message": f"stage {self.stage} serves another live coordinator (session {self.session}, "
                               f"heard from {now - self.seen:.1f} s ago); stop that one first"}
        self.ident, self.session, self.seen = ident, session, now
        return None

    def heard(self, ident: bytes, now: float) -> bool:
        """Whether a message from `ident` may go on (it is the owner's); the owner is alive as of `now`."""
        if self.ident is None or ident != self.ident:
            return False
        self.seen = now
        return True

    def bye(self, ident: bytes) -> None:
        """The owner said BYE: the next coordinator need not wait."""
        if ident == self.ident:
            self.ident = self.session = None
            self.seen = 0.0
