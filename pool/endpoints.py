"""The addresses a stage binds: `ipc:///path` or `tcp://host:port`, checked, and whether two hosts are one.

pool/config.py uses these for every stage's endpoint and data endpoint (no torch, no pydantic here).
"""
from __future__ import annotations

# Unix socket paths (ipc://) are limited by sockaddr_un.sun_path: 108 bytes including the final NUL.
MAX_IPC_PATH = 107
WILDCARD_HOSTS = {"0.0.0.0", "*", "::", "[::]", ""}
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


def check_endpoint(v: str) -> str:
    """`ipc:///path` (path at most MAX_IPC_PATH bytes) or `tcp://host:port` (port 1..65535)."""
    if v.startswith("ipc://"):
        path = v[len("ipc://"):]
        if not path:
            raise ValueError(f"{v!r}: ipc:// needs a socket path, e.g. ipc:///tmp/strata-stage-0")
        if len(path.encode()) > MAX_IPC_PATH:
            raise ValueError(f"{v!r}: ipc path is {len(path.encode())} bytes, unix sockets allow {MAX_IPC_PATH}")
        return v
    if v.startswith("tcp://"):
        host, sep, port = v[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{v!r}: expected tcp://host:port")
        if not 1 <= int(port) <= 65535:
            raise ValueError(f"{v!r}: port {int(port)} is out of range 1..65535")
        return v
    raise ValueError(f"{v!r}: use ipc:///path (same host) or tcp://host:port (any host)")


def tcp_host_port(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a checked `tcp://host:port` endpoint; None for an ipc:// one."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return host, int(port)


def same_host(a: str, b: str) -> bool:
    """Whether hosts `a` and `b` may be one machine: the same name, a wildcard (it binds every address), or both
    loopback. Used to refuse a stage port that is the coordinator's HTTP port."""
    if a == b or a in WILDCARD_HOSTS or b in WILDCARD_HOSTS:
        return True
    return a in LOOPBACK_HOSTS and b in LOOPBACK_HOSTS
