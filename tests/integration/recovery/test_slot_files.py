"""Session files with real processes: `POST /slots/{id}?action=save|restore` on a coordinator and two CPU stages.

A conversation saved, erased and restored continues with the tokens (and logprobs) of the run that never saved
it, and reports the same cached prefix. Damaged files, files of another model and names that leave the save
directory are refused with a 400 that says why, and change nothing: free cells and slots stay as they were.
A busy slot is a 409; a restore the pool cannot hold is a 503 `kv_pool_full` that changes nothing either.
Generation goes through the official `openai` client; slot actions through httpx.
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from pool.snapshot import PartReader, PartWriter

TURN1 = [{"role": "user", "content": "Tell me about the shared pool of chunks."}]
SCRIBBLE = [{"role": "user", "content": "Something else entirely, long enough to write over three chunks."}]
C = 16  # chunk_cells of the box


def turn2(first: dict) -> list[dict]:
    return [*TURN1, {"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And then?"}]


def same_run(a: dict, b: dict) -> None:
    assert (a["text"], a["tokens"], a["cached"]) == (b["text"], b["tokens"], b["cached"]), (a, b)
    assert all(abs(x - y) < 1e-4 for x, y in zip(a["logprobs"], b["logprobs"])), (a, b)


def slot_action(front, slot: int, action: str, filename: object = None, body: object = ...):
    payload = {"filename": filename} if body is ... else body
    return front.http.post(f"/slots/{slot}", params={"action": action}, json=payload)


def pool_state(front) -> tuple:
    pool = front.live()["kv_pool"]
    return pool["free"], [(s["state"], s["cells"], s["tokens"]) for s in pool["slots"]], pool["parked"]


def enable_saves(b) -> Path:
    saves = b.root / "saves"
    b.rewrite(engine={**b.data["engine"], "slot_save_path": str(saves)})
    return saves


def save_id(saves: Path, name: str) -> str:
    """The save id the tokens part (the manifest) of snapshot `name` names."""
    with PartReader(saves / name) as r:
        return r.header["save_id"]


def part(saves: Path, name: str, stage: int, of: str | None = None) -> Path:
    """Stage `stage`'s part of snapshot `name`, as its manifest (or snapshot `of`'s) names it."""
    return saves / f"{name}.{save_id(saves, of or name)}.stage{stage}"


def copy_save(saves: Path, src: str, dst: str, parts: tuple = (None, 0, 1)) -> None:
    """Snapshot `src` under the name `dst`: its manifest, and its stages' parts under that save id."""
    sid = save_id(saves, src)
    for p in parts:
        suffix = "" if p is None else f".{sid}.stage{p}"
        shutil.copy(saves / f"{src}{suffix}", saves / f"{dst}{suffix}")


def rewrite_header(path: Path, **changes: object) -> None:
    """The same payload under a header with `changes` (and a correct hash): refused for what changed."""
    with PartReader(path) as r:
        header, payload = dict(r.header), r.read(r.header["payload_nbytes"])
    for key in ("payload_nbytes", "payload_sha256"):
        header.pop(key)
    with PartWriter(path, {**header, **changes}, len(payload)) as w:
        w.write(payload)
        w.finish()


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


def test_save_erase_restore_and_continue_like_a_run_that_never_saved(box, coordinator):
    b = box(2, max_context=128, kv_pool_tokens=9 * C)
    saves = enable_saves(b)
    b.start_all()
    front = coordinator(b)

    first = front.chat(TURN1)
    r = slot_action(front, 0, "save", "conv1")
    assert r.status_code == 200, r.text
    saved = r.json()
    n = saved["n_saved"]
    assert saved["id_slot"] == 0 and saved["filename"] == "conv1" and math.ceil(n / C) == 3, saved
    files = [saves / "conv1", part(saves, "conv1", 0), part(saves, "conv1", 1)]
    assert sorted(saves.iterdir()) == sorted(files)  # nothing else: no temp file, no other save's part
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    assert saved["n_written"] == sum(f.stat().st_size for f in files) and saved["timings"]["save_ms"] > 0
    never_saved = front.chat(turn2(first), logprobs=True)  # the held conversation, as if nothing had happened
    assert never_saved["cached"] >= n - 8 > 0, never_saved

    assert front.http.post("/slots", params={"action": "erase"}).status_code == 200
    front.chat(SCRIBBLE)  # the freed chunks now hold other cells: a restore must write every byte back
    assert front.http.post("/slots", params={"action": "erase"}).status_code == 200
    pool = front.live()["kv_pool"]
    assert pool["free"] == pool["cells"] == 9 * C
    r = slot_action(front, 0, "restore", "conv1")
    assert r.status_code == 200, r.text
    restored = r.json()
    assert (restored["id_slot"], restored["filename"], restored["n_restored"], restored["n_read"]) == \
        (0, "conv1", n, saved["n_written"]), restored
    free, slots, _ = pool_state(front)
    assert free == 6 * C and slots[0] == ("held", 3 * C, n), slots
    same_run(front.chat(turn2(first), logprobs=True), never_saved)

    # Refusals: each is a 400 saying why, and nothing changes.
    before = pool_state(front)
    for bad in ["../conv1", "a/b", "..", ".conv1", "conv1.stage0", "x" * 129, "", None, 7]:
        for action in ("save", "restore"):
            r = slot_action(front, 0, action, bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "filename", (bad, r.text)
    assert slot_action(front, 0, "restore", body=["conv1"]).status_code == 400
    assert not (b.root / "conv1").exists() and pool_state(front) == before

    copy_save(saves, "conv1", "hash")
    flip_last_byte(saves / "hash")
    copy_save(saves, "conv1", "magic")
    with open(saves / "magic", "r+b") as f:
        f.write(b"NOTSTRAT")
    copy_save(saves, "conv1", "model")
    rewrite_header(saves / "model", model_fp="0123456789abcdef")
    copy_save(saves, "conv1", "stage1hash")
    flip_last_byte(part(saves, "stage1hash", 1))
    copy_save(saves, "conv1", "stage0cut")
    os.truncate(part(saves, "stage0cut", 0), part(saves, "stage0cut", 0).stat().st_size - 100)
    copy_save(saves, "conv1", "stage1model")
    rewrite_header(part(saves, "stage1model", 1), model_fp="0123456789abcdef")
    copy_save(saves, "conv1", "mixed", parts=(None, 0))
    r = slot_action(front, 1, "save", "other")  # slot 1 holds nothing: refused, nothing written
    assert r.status_code == 400 and "holds no conversation" in r.text and not (saves / "other").exists()
    assert slot_action(front, 0, "save", "other").status_code == 200  # slot 0's turn 2: another save id
    shutil.copy(part(saves, "other", 1), part(saves, "mixed", 1))
    cases = {
        "nope": "nope: no such snapshot file",
        "hash": "hash: the payload hash does not match its header",
        "magic": "magic: bad magic, not a Strata snapshot",
        "model": "model: refused, it was saved from another model (checkpoint fingerprint 0123456789abcdef",
        "stage1hash": f"stage 1: {part(saves, 'stage1hash', 1).name}: the payload hash does not match",
        "stage0cut": f"stage 0: {part(saves, 'stage0cut', 0).name} is truncated",
        "stage1model": f"stage 1: {part(saves, 'stage1model', 1).name}: refused, it was saved from another model",
        "mixed": f"stage 1: {part(saves, 'mixed', 1).name}: refused, it belongs to another save",
    }
    before = pool_state(front)
    for name, why in cases.items():
        for slot in (0, 2):  # the slot holding a conversation, and an empty one
            r = slot_action(front, slot, "restore", name)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(why), (name, r.text)
            assert pool_state(front) == before, name
    again = front.chat(turn2(first))  # slot 0's conversation is still whole: all but the last token cached
    assert again["cached"] > never_saved["cached"], again


def test_busy_slots_and_a_full_pool_refuse_a_restore_and_change_nothing(box, coordinator):
    b = box(2, max_context=128, kv_pool_tokens=9 * C)
    enable_saves(b)
    b.start_all()
    front = coordinator(b)
    first = front.chat(TURN1)
    r = slot_action(front, 0, "save", "conv1")
    assert r.status_code == 200, r.text
    n = r.json()["n_saved"]
    reference = front.chat(turn2(first), logprobs=True)

    # A slot running a request: 409 for every slot action. Stage 1 is frozen so the request stays running.
    stage1 = b.procs[1].pid
    os.kill(stage1, signal.SIGSTOP)
    try:
        busy = threading.Thread(target=lambda: front.chat([{"role": "user", "content": "Hold the slot."}]))
        busy.start()
        deadline = time.monotonic() + 1.0
        while not any(s["is_processing"] for s in front.http.get("/slots").json()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        slot = next(s["id"] for s in front.http.get("/slots").json() if s["is_processing"])
        for action in ("save", "restore", "erase"):
            r = slot_action(front, slot, action, "conv1")
            assert r.status_code == 409 and r.json()["error"]["code"] == "slot_busy", (action, r.text)
    finally:
        os.kill(stage1, signal.SIGCONT)
    busy.join(30)

    # Four restores of a 3-chunk conversation into a 9-chunk pool at once: the fourth finds the other three's
    # chunks reserved (not yet held, so not evictable) and gets a 503; it changes nothing.
    assert front.http.post("/slots", params={"action": "erase"}).status_code == 200
    results: dict[int, object] = {}
    os.kill(stage1, signal.SIGSTOP)  # every restore's check waits in stage 1's queue: they all reserve in order
    try:
        threads = [threading.Thread(target=lambda s=s: results.__setitem__(s, slot_action(front, s, "restore", "conv1")))
                   for s in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
    finally:
        os.kill(stage1, signal.SIGCONT)
    for t in threads:
        t.join(30)
    codes = sorted(r.status_code for r in results.values())
    assert codes == [200, 200, 200, 503], {s: r.text for s, r in results.items()}
    full = next(s for s, r in results.items() if r.status_code == 503)
    err = results[full]
    assert err.json()["error"]["code"] == "kv_pool_full" and err.headers.get("retry-after"), err.text
    free, slots, parked = pool_state(front)
    assert free == 0 and parked == [] and slots[full] == ("free", 0, 0), slots
    assert [s for i, s in enumerate(slots) if i != full] == [("held", 3 * C, n)] * 3

    # Now the pool is full of idle conversations: the same restore evicts the least recently used one.
    evictions = front.live()["counters"]["evictions"]
    r = slot_action(front, full, "restore", "conv1")
    assert r.status_code == 200, r.text
    assert front.live()["counters"]["evictions"] == evictions + 1
    _, slots, _ = pool_state(front)
    assert slots[full][0] == "held" and sum(s[0] == "held" for s in slots) == 3
    front.http.post("/slots", params={"action": "erase"})  # only slot `full`'s conversation may match now
    assert slot_action(front, full, "restore", "conv1").status_code == 200
    same_run(front.chat(turn2(first), logprobs=True), reference)


def test_without_the_pool_a_restore_lands_in_the_park_region_and_moves_in_by_copy(box, coordinator):
    """Pool off (the baseline): the restore reads into the park table's fixed region, then the move into the
    slot is an "exchange" (a byte copy), and the slot's previous conversation is parked in its place."""
    b = box(2, pool=False, max_context=128)
    enable_saves(b)
    b.start_all()
    front = coordinator(b)
    first = front.chat(TURN1)
    r = slot_action(front, 0, "save", "conv1")
    assert r.status_code == 200, r.text
    never_saved = front.chat(turn2(first), logprobs=True)
    front.http.post("/slots", params={"action": "erase"})
    front.chat(SCRIBBLE)  # slot 0's region now holds other cells, and a conversation to park
    r = slot_action(front, 0, "restore", "conv1")
    assert r.status_code == 200, r.text
    pool = front.live()["kv_pool"]
    assert pool["slots"][0]["tokens"] == r.json()["n_restored"] and len(pool["parked"]) == 1, pool
    same_run(front.chat(turn2(first), logprobs=True), never_saved)


def test_a_save_that_fails_on_one_stage_keeps_the_previous_snapshot_whole(box, coordinator):
    """Stage 1 cannot grow a file past 1 KiB (RLIMIT_FSIZE: its write fails with EFBIG, as on a full disk): the
    second save of "conv" is a 507 naming stage 1, and the first save still restores and continues like a run
    that never saved. Then a save that works replaces it and leaves only its own parts."""
    import resource

    b = box(2, max_context=128, kv_pool_tokens=9 * C)
    saves = enable_saves(b)
    b.start_all()
    front = coordinator(b)
    first = front.chat(TURN1)
    assert slot_action(front, 0, "save", "conv").status_code == 200
    kept = sorted(saves.iterdir())
    reference = front.chat(turn2(first), logprobs=True)  # slot 0 now holds a longer conversation

    stage1 = b.procs[1].pid
    limits = resource.prlimit(stage1, resource.RLIMIT_FSIZE)
    resource.prlimit(stage1, resource.RLIMIT_FSIZE, (1024, limits[1]))
    try:
        r = slot_action(front, 0, "save", "conv")
    finally:
        resource.prlimit(stage1, resource.RLIMIT_FSIZE, limits)
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_storage" and err["message"].startswith("stage 1: "), err
    assert "previous snapshot of that name is kept" in err["message"]
    assert sorted(saves.iterdir()) == kept  # stage 0's part of the failed save is gone, the old parts are whole

    assert front.http.post("/slots", params={"action": "erase"}).status_code == 200
    r = slot_action(front, 0, "restore", "conv")
    assert r.status_code == 200, r.text
    same_run(front.chat(turn2(first), logprobs=True), reference)

    r = slot_action(front, 0, "save", "conv")  # the held turn 2 now: a new save id, and the old parts removed
    assert r.status_code == 200, r.text
    now = sorted(saves.iterdir())
    assert len(now) == 3 and now != kept and all(p.exists() for p in (part(saves, "conv", 0), part(saves, "conv", 1)))
    front.http.post("/slots", params={"action": "erase"})


def test_snapshot_files_are_never_read_through_a_symlink(box, coordinator):
    b = box(2, max_context=128, kv_pool_tokens=9 * C)
    saves = enable_saves(b)
    b.start_all()
    front = coordinator(b)
    front.chat(TURN1)
    assert slot_action(front, 0, "save", "conv").status_code == 200
    secret = b.root / "secret"
    secret.write_bytes(b"STRATASN" + b"top secret bytes" * 8)
    (saves / "link").symlink_to(secret)
    copy_save(saves, "conv", "partlink")
    target = part(saves, "partlink", 1)
    target.unlink()
    target.symlink_to(part(saves, "conv", 1))
    before = pool_state(front)
    for name, why in {"link": "link is a symlink", "partlink": f"stage 1: {target.name} is a symlink"}.items():
        r = slot_action(front, 2, "restore", name)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(why), r.text
        assert "secret" not in r.text and pool_state(front) == before
    front.http.post("/slots", params={"action": "erase"})
