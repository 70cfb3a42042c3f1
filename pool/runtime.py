"""The box's private files: its runtime directories, the locks a live process holds, the box key.

No torch here; stages, the coordinator and `strata up` all use it.

Rules:
- A private directory is owned by this process's user and has no group or other permission bits (0700). It is
  created with mode 0700 when missing, and checked through a descriptor opened with O_NOFOLLOW: a symlink, a
  directory of another user or one that others may enter is refused (RuntimeDirError naming the path and the
  reason), never used nor "fixed" by chmod.
- Two of them: `runtime_dir()` for ipc sockets and the box key (`$STRATA_RUNTIME_DIR`; else
  `$XDG_RUNTIME_DIR/strata`; else `/tmp/strata-<uid>`), and `pool_dir()` for pool files, which need a
  RAM-backed filesystem as large as the pools (`$STRATA_POOL_DIR`; else `/dev/shm/strata-<uid>`; else the
  runtime dir). A path written `{runtime}/...` in an ipc endpoint is the runtime dir.
- Private files (`open_private`) are opened with O_NOFOLLOW and accepted only when they are regular files of this
  user with mode 0600; new ones are made with O_CREAT | O_EXCL and mode 0600.
- `hold(path)` takes an exclusive, non-blocking flock on `path` (a lock file, made 0600 if missing) and writes
  the holder's pid into it; the kernel drops the lock when the holder dies, so a crashed process never blocks
  its successor, and a live one always refuses a second (InUse names the pid). A holder that lets go removes the
  file while it still holds the lock; a lock counts only while `path` still names the file it was taken on, so a
  process that opened the file before its removal finds that out after its flock and takes the lock anew (a
  clean stop leaves no lock file behind, and no two processes ever hold one name).
- The box key: 32 random bytes, hex, in `box.key_file` or `<runtime_dir>/box.key`. The first process that needs
  it and finds none makes it: written to a temp file, then linked into place (link fails if another process won
  the race, and that one's key is read instead), so every process of a box on a host agrees. Boxes on several
  hosts share one file made by `strata keygen`. Tokens are HMAC-SHA256 of a purpose string under the key;
  they prove a peer holds the key without sending it.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path

RUNTIME_MARK = "{runtime}"
KEY_BYTES = 32
HOLD_TRIES = 100  # opens of a lock file that holders keep removing, before hold gives up


class RuntimeDirError(RuntimeError):
    """A directory or file that should be private is not (or cannot be made); the message says why."""


class InUse(RuntimeError):
    """A lock another live process holds; `.pid` is its pid when it wrote one."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


def _uid_name(base: str | Path) -> Path:
    return Path(base) / f"strata-{os.geteuid()}"


def runtime_dir(create: bool = True) -> Path:
    """The private directory of ipc sockets and the box key (module rules)."""
    if os.environ.get("STRATA_RUNTIME_DIR"):
        path = Path(os.environ["STRATA_RUNTIME_DIR"])
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "strata"
    else:
        path = _uid_name(tempfile.gettempdir())
    return private_dir(path) if create else path


def pool_dir(create: bool = True) -> Path:
    """The private directory of pool files: RAM-backed when /dev/shm exists (module rules)."""
    if os.environ.get("STRATA_POOL_DIR"):
        path = Path(os.environ["STRATA_POOL_DIR"])
    elif os.path.isdir("/dev/shm"):
        path = _uid_name("/dev/shm")
    else:
        return runtime_dir(create)
    return private_dir(path) if create else path


def expand(endpoint: str) -> str:
    """`ipc://{runtime}/x` -> `ipc://<runtime_dir()>/x`; anything else unchanged (the directory is not made)."""
    if RUNTIME_MARK in endpoint:
        return endpoint.replace(RUNTIME_MARK, str(runtime_dir(create=False)))
    return endpoint


def check_private(path: Path, st: os.stat_result, what: str, mode: int) -> None:
    """RuntimeDirError unless `st` (of `path`) is this user's and has exactly the permission bits `mode` or fewer
    (no group/other bits at all)."""
    if st.st_uid != os.geteuid():
        raise RuntimeDirError(f"{what} {path} is owned by uid {st.st_uid}, not this user ({os.geteuid()}); "
                              f"refusing to use it")
    if stat.S_IMODE(st.st_mode) & 0o077 or stat.S_IMODE(st.st_mode) & ~mode:
        raise RuntimeDirError(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be {mode:04o} "
                              f"(private to its user)")


def private_dir(path: str | Path) -> Path:
    """`path` as a checked private directory (made 0700 with its missing parents if absent)."""
    path = Path(path)
    if path.is_symlink():
        raise RuntimeDirError(f"runtime directory {path} is a symlink; refusing to use it")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass  # another process of the box made it first: checked below like any other
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as err:
        why = "is a symlink" if err.errno == errno.ELOOP else ("is not a directory" if err.errno == errno.ENOTDIR
                                                              else os.strerror(err.errno))
        raise RuntimeDirError(f"runtime directory {path} {why}; refusing to use it") from None
    try:
        check_private(path, os.fstat(fd), "runtime directory", 0o700)
    finally:
        os.close(fd)
    return path


def open_private(path: str | Path, flags: int, create: bool = False) -> int:
    """A descriptor on private file `path` (module rules); `create` makes a new one exclusively (FileExistsError if
    there is one). RuntimeDirError when the file is a symlink, not regular, not ours or not 0600."""
    path = Path(path)
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    if create:
        flags |= os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise RuntimeDirError(f"{path} is a symlink; refusing to open it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RuntimeDirError(f"{path} is not a regular file; refusing to open it")
        check_private(path, st, "file", 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Hold:
    """An flock held on a lock file for the life of this object (see `hold`)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd  # type: Path, int | None

    def release(self) -> None:
        """Remove the lock file, still holding it (when the name is still this file), then drop the lock."""
        if self._fd is None:
            return
        try:
            if names_fd(self.path, self._fd):
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def names_fd(path: Path, fd: int) -> bool:
    """Whether `path` (not followed) is the file open on `fd`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def lock_fd(fd: int, path: Path, what: str) -> None:
    """An exclusive non-blocking flock on `fd`; InUse (with the pid written in the file, if any) when held."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = holder_pid(path)
        raise InUse(f"{what} is in use by a live process{f' (pid {pid})' if pid else ''}", pid) from None


def holder_pid(path: Path) -> int | None:
    """The pid a holder wrote into lock file `path`, None when unreadable."""
    try:
        fd = open_private(path, os.O_RDONLY)
    except (OSError, RuntimeDirError):
        return None
    try:
        raw = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    return int(raw) if raw.isdigit() else None


def hold(path: str | Path, what: str) -> Hold:
    """Take the lock file `path` (module rules); InUse when a live process holds it."""
    path = Path(path)
    for _ in range(HOLD_TRIES):
        try:
            fd = open_private(path, os.O_RDWR, create=True)
        except FileExistsError:
            try:
                fd = open_private(path, os.O_RDWR)
            except FileNotFoundError:  # removed by a holder letting go since: make it anew
                continue
        try:
            lock_fd(fd, path, what)
            if not names_fd(path, fd):  # the holder removed it between our open and our lock
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return Hold(path, fd)
    raise InUse(f"{what}: its lock file {path} kept being replaced while this process took it", None)


def is_held(path: str | Path) -> int | None:
    """The pid holding lock file `path` (0 when its pid is unknown), None when nobody holds it. Changes nothing."""
    path = Path(path)
    try:
        fd = open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return holder_pid(path) or 0
    finally:
        os.close(fd)
    return None


def key_path(key_file: str | None) -> Path:
    """Where the box key is: `box.key_file`, or `<runtime_dir>/box.key`."""
    return Path(key_file).expanduser() if key_file else runtime_dir() / "box.key"


def write_key(path: str | Path) -> bytes:
    """Make a new key file at `path` (0600, exclusively; FileExistsError if there is one) and return the key."""
    path = Path(path)
    key = secrets.token_hex(KEY_BYTES).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = open_private(tmp, os.O_WRONLY, create=True)
    try:
        os.write(fd, key + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic, and never replaces a file another process made
    finally:
        tmp.unlink(missing_ok=True)
    return key


def read_key(path: str | Path) -> bytes:
    """The key in private file `path`; RuntimeDirError when it is not private or not a key (its bytes are never
    quoted)."""
    fd = open_private(path, os.O_RDONLY)
    try:
        raw = os.read(fd, 4 * KEY_BYTES).strip()
    finally:
        os.close(fd)
    if len(raw) < KEY_BYTES:
        raise RuntimeDirError(f"box key file {path} holds {len(raw)} bytes, not a key (strata keygen makes one)")
    return raw


def box_key(key_file: str | None) -> bytes:
    """The box key (module rules): read, or made on first use when `key_file` is the default."""
    path = key_path(key_file)
    try:
        return read_key(path)
    except FileNotFoundError:
        if key_file:
            raise RuntimeDirError(f"box.key_file {path} does not exist; make it with `strata keygen {path}`") from None
    try:
        return write_key(path)
    except FileExistsError:
        return read_key(path)


def token(key: bytes, purpose: str) -> str:
    """HMAC-SHA256 of `purpose` under `key`, hex."""
    return hmac.new(key, purpose.encode(), hashlib.sha256).hexdigest()


def same_token(a: object, b: str) -> bool:
    """Constant-time comparison of a received token with the expected one."""
    return isinstance(a, str) and hmac.compare_digest(a.encode(), b.encode())
