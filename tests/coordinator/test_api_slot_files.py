"""The HTTP side of `POST /slots/{id}?action=save|restore`: 501 without `engine.slot_save_path`, the body's
filename handed to the engine as given, bad bodies 400, the engine's refusals in the OpenAI error shape."""
from __future__ import annotations

import httpx

from coordinator.api import make_app
from coordinator.engine import EngineError
from pool.config import config_from_dict
from tests.coordinator.fake_engine import FakeEngine, serve


class FilingEngine(FakeEngine):
    """The fake engine plus slot files that record their calls and answer like the scheduler does."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.calls: list[tuple] = []
        self.refuse_file: EngineError | None = None

    async def save_slot(self, slot: int, filename: object) -> dict:
        self.calls.append(("save", slot, filename))
        if self.refuse_file:
            raise self.refuse_file
        return {"id_slot": slot, "filename": filename, "n_saved": 42, "n_written": 4096, "timings": {"save_ms": 1.5}}

    async def restore_slot(self, slot: int, filename: object) -> dict:
        self.calls.append(("restore", slot, filename))
        if self.refuse_file:
            raise self.refuse_file
        return {"id_slot": slot, "filename": filename, "n_restored": 42, "n_read": 4096,
                "timings": {"restore_ms": 2.5}}


def front(tokenizer, tmp_path, enabled: bool):
    engine = FilingEngine(tokenizer)
    cfg = config_from_dict({"engine": {"slot_save_path": str(tmp_path) if enabled else None}})
    return engine, serve(make_app(cfg, engine, tokenizer))


def test_without_a_save_path_the_actions_answer_501(tokenizer, tmp_path):
    engine, server = front(tokenizer, tmp_path, enabled=False)
    with server as url:
        for action in ("save", "restore"):
            r = httpx.post(f"{url}/slots/0", params={"action": action}, json={"filename": "conv"})
            assert r.status_code == 501, r.text
            err = r.json()["error"]
            assert err["code"] == "not_supported" and "engine.slot_save_path" in err["message"]
        r = httpx.post(f"{url}/slots/0", params={"action": "erase"})
        assert r.status_code == 200 and r.json() == {"id_slot": 0, "n_erased": 7}
        r = httpx.post(f"{url}/slots/0", params={"action": "explode"})
        assert r.status_code == 400 and "erase, save and restore" in r.json()["error"]["message"]
    assert engine.calls == []


def test_the_filename_reaches_the_engine_and_its_answer_comes_back(tokenizer, tmp_path):
    engine, server = front(tokenizer, tmp_path, enabled=True)
    with server as url:
        r = httpx.post(f"{url}/slots/1", params={"action": "save"}, json={"filename": "conv"})
        assert r.status_code == 200 and r.json()["n_saved"] == 42, r.text
        r = httpx.post(f"{url}/slots/2", params={"action": "restore"}, json={"filename": "../x"})
        assert r.status_code == 200 and r.json()["n_restored"] == 42  # the engine decides (the fake accepts)
        assert httpx.post(f"{url}/slots/0", params={"action": "save"}).status_code == 200  # no body: filename None
        for body in (b"[1]", b"{not json", b'"conv"'):
            r = httpx.post(f"{url}/slots/0", params={"action": "restore"}, content=body)
            assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"], body
        engine.refuse_file = EngineError(409, "slot_busy", "slot 3 is processing a request")
        r = httpx.post(f"{url}/slots/3", params={"action": "restore"}, json={"filename": "conv"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "slot_busy"
        engine.refuse_file = EngineError.kv_pool_full(48, 0, retry_after=7)
        r = httpx.post(f"{url}/slots/3", params={"action": "restore"}, json={"filename": "conv"})
        assert r.status_code == 503 and r.headers["retry-after"] == "7"
    assert engine.calls == [("save", 1, "conv"), ("restore", 2, "../x"), ("save", 0, None),
                            ("restore", 3, "conv"), ("restore", 3, "conv")]
