"""ZeroMQ CURVE for the stage protocol: the keys `strata keygen` makes and how each socket uses them.

    strata keygen DIR        DIR (0700): box.key          the box key (pool/runtime.py), HMAC for HELLO and HIDDEN
                                         server.key_secret the stages' keypair (every ROUTER and PULL a stage binds)
                                         client.key_secret the box's client keypair (the coordinator's DEALERs, a
                                                           stage's PUSH to the next stage)
                                         allowed/client.key the only public key the stages' ZAP handler lets in

Rules:
- With `box.curve_dir` set, every socket of the stage protocol is a CURVE socket: a peer without the server's
  public key cannot even complete the handshake, and one without the box's client secret key is refused by the
  ZAP handler (pyzmq's ThreadAuthenticator, run in each stage). Traffic is encrypted. The box key in DIR is the
  default `box.key_file`, so one directory copied to every host is the whole secret of the box.
- Key files are private (0600, the directory 0700) and read through pool/runtime.py's checks.
- Without `box.curve_dir`, tcp endpoints on a loopback host are allowed (the box key still authenticates HELLO
  and HIDDEN); a tcp endpoint on any other host is refused by the config (pool/config.py), since its traffic
  would cross a network in clear.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from pool.runtime import open_private, private_dir, write_key


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    allowed: Path  # the directory of public keys the ZAP handler accepts


def keygen(directory: str | Path) -> Path:
    """Make a new key directory (it must not exist, or be empty); returns it."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty; keys are never overwritten")
    private_dir(directory)
    write_key(directory / "box.key")
    scratch = private_dir(directory / ".new")
    try:
        for name in ("server", "client"):
            public, secret = zmq.auth.create_certificates(str(scratch), name)
            os.chmod(secret, 0o600)
            os.replace(secret, directory / f"{name}.key_secret")
        allowed = private_dir(directory / "allowed")
        os.chmod(scratch / "client.key", 0o600)
        os.replace(scratch / "client.key", allowed / "client.key")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return directory


def _certificate(path: Path) -> tuple[bytes, bytes]:
    os.close(open_private(path, os.O_RDONLY))  # private, regular, not a link: checked before pyzmq reads it
    public, secret = zmq.auth.load_certificate(str(path))
    if secret is None:
        raise ValueError(f"{path} holds no secret key (strata keygen makes one)")
    return public, secret


def load_keys(directory: str | Path) -> CurveKeys:
    """The keys of `directory` as `keygen` made them; RuntimeDirError / ValueError naming the file otherwise."""
    directory = private_dir(directory)
    sp, ss = _certificate(directory / "server.key_secret")
    cp, cs = _certificate(directory / "client.key_secret")
    return CurveKeys(sp, ss, cp, cs, private_dir(directory / "allowed"))


def key_file(curve_dir: str | None, key_file: str | None) -> str | None:
    """The box key file: `box.key_file`, else the curve directory's box.key, else None (the runtime dir's)."""
    if key_file:
        return key_file
    return str(Path(curve_dir).expanduser() / "box.key") if curve_dir else None


def serve_on(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make `sock` (before bind) a CURVE server with the stages' keypair; nothing without keys."""
    if keys is not None:
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
        sock.curve_server = True


def connect_with(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make `sock` (before connect) a CURVE client of the stages with the box's client keypair."""
    if keys is not None:
        sock.curve_secretkey = keys.client_secret
        sock.curve_publickey = keys.client_public
        sock.curve_serverkey = keys.server_public


def authenticator(ctx: zmq.Context, keys: CurveKeys | None) -> ThreadAuthenticator | None:
    """A started ZAP handler on `ctx` that lets in only the box's client key; None without keys."""
    if keys is None:
        return None
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.allowed))
    return auth
