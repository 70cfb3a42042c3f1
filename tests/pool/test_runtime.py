"""pool/runtime.py: private directories and files, locks a live process holds, the box key; and the pool file
refusing to be attached when it is not private."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pool.memory import PoolLayout, PoolMemory
from pool.runtime import (InUse, RuntimeDirError, box_key, hold, is_held, open_private, private_dir, read_key,
                          same_token, token)

REPO = Path(__file__).resolve().parents[2]
LAYOUT = PoolLayout(n_layers=1, n_chunks=2, chunk_cells=4, kv_heads=1, head_dim=8, kv_dtype="float32")


@pytest.fixture
def private(tmp_path: Path) -> Path:
    os.chmod(tmp_path, 0o700)
    return tmp_path


def test_private_dir_is_made_0700_and_others_are_refused(private):
    made = private_dir(private / "a" / "b")
    assert made.stat().st_mode & 0o777 == 0o700
    open_dir = private / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(RuntimeDirError, match="has mode 0755; it must be 0700"):
        private_dir(open_dir)
    assert open_dir.stat().st_mode & 0o777 == 0o755  # refused, never chmod-ed
    (private / "link").symlink_to(made)
    with pytest.raises(RuntimeDirError, match="is a symlink"):
        private_dir(private / "link")


def test_private_files_are_exclusive_0600_and_never_followed(private):
    fd = open_private(private / "f", os.O_WRONLY, create=True)
    os.close(fd)
    assert (private / "f").stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        open_private(private / "f", os.O_WRONLY, create=True)
    (private / "g").write_text("x")
    os.chmod(private / "g", 0o644)
    with pytest.raises(RuntimeDirError, match="has mode 0644; it must be 0600"):
        open_private(private / "g", os.O_RDONLY)
    (private / "l").symlink_to(private / "f")
    with pytest.raises(RuntimeDirError, match="is a symlink"):
        open_private(private / "l", os.O_RDONLY)


HOLDER = textwrap.dedent("""
    import sys, time
    from pool.runtime import hold
    h = hold(sys.argv[1], "test lock")
    print("held", flush=True)
    time.sleep(60)
""")


def test_a_lock_is_refused_while_its_holder_lives_and_free_once_it_dies(private):
    path = private / "x.lock"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "held"
        assert is_held(path) == proc.pid
        with pytest.raises(InUse, match=f"test lock is in use by a live process \\(pid {proc.pid}\\)") as err:
            hold(path, "test lock")
        assert err.value.pid == proc.pid
    finally:
        proc.kill()  # no clean exit: the kernel drops the lock
        proc.wait()
    assert is_held(path) is None
    held = hold(path, "test lock")
    assert path.exists() and is_held(path) == os.getpid()
    held.release()
    assert not path.exists()  # a holder that lets go leaves no lock file (module rules)


def test_a_lock_taken_on_a_file_its_holder_removed_is_taken_anew(private, monkeypatch):
    """A process that opened the lock file just before its holder let go (removing it) gets the flock on a
    file no name leads to; it must see that and take the lock on the name's new file, or two could hold one name."""
    from pool import runtime

    path = private / "x.lock"
    first = hold(path, "test lock")
    real_open = runtime.open_private
    opened = []

    def racing_open(p, flags, create=False):
        fd = real_open(p, flags, create)
        if not opened:  # this process has the old file open; its holder lets go before this one's flock
            first.release()
        opened.append(fd)
        return fd

    monkeypatch.setattr(runtime, "open_private", racing_open)
    second = hold(path, "test lock")
    assert len(opened) == 2 and runtime.names_fd(path, second._fd)
    assert is_held(path) == os.getpid()
    monkeypatch.setattr(runtime, "open_private", real_open)
    with pytest.raises(InUse):
        hold(path, "test lock")  # the name's lock is held: refused, as for any second holder
    second.release()
    assert not path.exists()


KEYER = "import sys; from pool.runtime import box_key; print(box_key(None).decode())"


def test_the_box_key_is_made_once_and_every_process_reads_the_same(private):
    env = {**os.environ, "PYTHONPATH": str(REPO), "STRATA_RUNTIME_DIR": str(private / "run")}
    procs = [subprocess.Popen([sys.executable, "-c", KEYER], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    keys = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert len(keys) == 1 and len(keys.pop()) == 64
    key_file = private / "run" / "box.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in (private / "run").iterdir()] == ["box.key"]  # no temp file left behind


def test_a_named_key_file_must_exist_and_be_a_key(private, monkeypatch):
    with pytest.raises(RuntimeDirError, match="strata keygen"):
        box_key(str(private / "missing.key"))
    short = private / "short.key"
    fd = open_private(short, os.O_WRONLY, create=True)
    os.write(fd, b"secret-bytes")
    os.close(fd)
    with pytest.raises(RuntimeDirError) as err:
        read_key(short)
    assert "secret-bytes" not in str(err.value)


def test_tokens_prove_the_key_without_showing_it():
    a, b = token(b"k" * 64, "hello:s1"), token(b"k" * 64, "hello:s2")
    assert a != b and same_token(a, token(b"k" * 64, "hello:s1")) and not same_token(a, token(b"j" * 64, "hello:s1"))
    assert not same_token(None, a) and "k" * 8 not in a


def test_a_pool_file_that_is_not_private_is_not_attached(private):
    path = private / "pool"
    PoolMemory.create(path, LAYOUT).close()
    assert path.stat().st_mode & 0o777 == 0o600
    os.chmod(path, 0o640)
    with pytest.raises(RuntimeDirError, match="mode 0640"):
        PoolMemory.attach(path, LAYOUT)
    os.chmod(path, 0o600)
    (private / "alias").symlink_to(path)
    with pytest.raises(RuntimeDirError, match="symlink"):
        PoolMemory.attach(private / "alias", LAYOUT)
    PoolMemory.attach(path, LAYOUT).close()
