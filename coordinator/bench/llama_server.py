"""The `llama-server` peers of `strata bench peers`: llama.cpp's own HTTP server (continuous batching over
`-np` slots) on the GGUF file the llama.cpp peer reads, measured by the same client code as Strata (serve.py's
stream_request: token-id prompts to /v1/completions, greedy, `ignore_eos`), so its figures compare like with like.

    llama-server       the server as shipped: K/V cache f16, flash attention auto (both changeable with
                       --llama-kv and --llama-flash-attn; --llama-repack off adds --no-repack)
    llama-server-f32   K/V cache f32 and flash attention off (the K/V precision of Strata's float32 stages)

The binary is built once by `python -m stages.llama_server build` (stages/llama_server.py: from the llama.cpp
sources llama-cpp-python vendors) into the user cache; without it the peers are skipped with a note naming that
command. A peer's server runs on a free loopback port with `-np <slots> -c <slots x cells per slot>
-t/-tb <threads>` (the thread budget every peer gets) and is always stopped (SIGTERM, then SIGKILL after 15 s,
also when the benchmark fails or is killed: on Linux the server gets SIGTERM when this process dies).

llama-server's `ignore_eos` biases its end-of-generation tokens to -inf (they are never sampled), where Strata's
samples them like any token and goes on; the timed requests generate the same number of tokens either way. Its
greedy check therefore runs without `ignore_eos` (POST /completion with `return_tokens`): its ids must equal the
reference's for as many as it generated, and a stop at an end-of-generation token is said in the note.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from . import run_child
from .strata_server import ServerProcess

PEERS = ("llama-server", "llama-server-f32")
STOP_S = 15.0


def locate(explicit: str | None) -> tuple[str | None, str]:
    """(the binary, "") or (None, why it is missing): `explicit` when given, else the cached build's."""
    if explicit:
        ok = Path(explicit).is_file() and os.access(explicit, os.X_OK)
        return (explicit, "") if ok else (None, f"--llama-server {explicit} is not an executable file")
    found = run_child("stages.llama_server", ["path"])
    return found.get("binary"), found.get("missing", "")


def kv_and_fa(peer: str, kv: str, flash_attn: str) -> tuple[str, str]:
    """The K/V cache type and flash-attention mode of a llama-server peer."""
    return ("f32", "off") if peer == "llama-server-f32" else (kv, flash_attn)


def server_args(binary: str, gguf: str, port: int, slots: int, cells_per_slot: int, threads: int, kv: str,
                flash_attn: str, alias: str, repack: bool = True) -> list[str]:
    """The command line of one llama-server peer: every slot gets cells_per_slot cells of context."""
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--alias", alias,
            "-np", str(slots), "-c", str(slots * cells_per_slot), "-t", str(threads), "-tb", str(threads),
            "-ctk", kv, "-ctv", kv, "-fa", flash_attn, *([] if repack else ["--no-repack"]), "--no-webui"]


class LlamaServer(ServerProcess):
    """llama-server on a command line (/health answers 200 once the model is loaded)."""

    name = "llama-server"
    stop_s = STOP_S


def greedy_ids(url: str, prompt: list[int], n: int) -> tuple[list[int], str]:
    """llama-server's first n greedy ids for `prompt` (no ignore_eos: see the module docstring) and its stop
    type ("limit": it generated n; "eos": it stopped at an end-of-generation token)."""
    body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "return_tokens": True, "cache_prompt": False,
            "stream": False}
    resp = httpx.post(url + "/completion", json=body, timeout=600.0)
    if resp.status_code != 200:
        raise RuntimeError(f"llama-server greedy request: HTTP {resp.status_code}: {resp.text[:200]}")
    data = resp.json()
    return list(data.get("tokens") or []), str(data.get("stop_type", "?"))


def greedy_note(peer: str, ids: list[int], stop: str, reference: list[int], against: str, n: int) -> str:
    """The greedy check's note: ids equal to the reference's for as many as the server generated."""
    same = bool(ids) and ids == reference[:len(ids)]
    verdict = "equal" if same else "DIFFER from"
    if len(ids) >= n or stop != "eos":
        return f"greedy check: {peer}'s first {len(ids)} greedy token ids {verdict} {against}' for the same prompt"
    return (f"greedy check: {peer}'s greedy token ids {verdict} {against}' for the {len(ids)} it generated "
            f"before it stopped at an end-of-generation token (of {n} asked; llama-server stops there without "
            "ignore_eos and never samples one with it)")


def peer_cmd(args: Any, peer: str, binary: str, gguf: str, port: int, slots: int,
             cells_per_slot: int) -> tuple[list[str], str]:
    """The peer's command line and a note saying how it ran."""
    kv, fa = kv_and_fa(peer, args.llama_kv, args.llama_flash_attn)
    repack = getattr(args, "llama_repack", "on") == "on"
    cmd = server_args(binary, gguf, port, slots, cells_per_slot, args.threads, kv, fa, alias=peer, repack=repack)
    note = (f"{peer}: llama.cpp's server ({binary}) on {Path(gguf).name}: -np {slots} -c {slots * cells_per_slot} "
            f"(continuous batching), -t/-tb {args.threads}, K/V cache {kv}, flash attention {fa}"
            f"{'' if repack else ', --no-repack (quantized weights read in their file layout)'}; the other "
            "settings as shipped")
    return cmd, note
