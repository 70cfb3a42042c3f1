"""Grammar masks on the last stage: a step's packed token bitmasks applied to the logit rows they belong to.

The coordinator's matcher (coordinator/grammar.py) sends, in the step header, `"masks": {slot: bytes}` for the
sampled slots whose request has a grammar. Each mask is the allowed set of that slot's next token:

    bytes   0   1   2   3 | 4   5   6   7 | ... | 4W-4 .. 4W-1        W = ceil(vocab / 32)
    word    0 (int32 LE)  | 1             | ... | W-1
    token t allowed  <=>  bit t % 32 of word t // 32  <=>  bit t % 8 of byte t // 8

so the words are read as bytes (the same bits on any host byte order) and unpacked with one shift per bit
position, on the logits' device: only the packed bytes (vocab / 8 per row) cross to a GPU.

Rules:
1. A masked row keeps its logit where the mask allows the token and becomes -inf everywhere else, so a
   masked token is never sampled, greedy or not, and every logprob is over the masked distribution; rows
   without a mask are returned unchanged (a mask never touches another row).
2. A mask is refused (ValueError naming the slot) when it is not exactly 4 * W bytes, allows an id past the
   vocabulary, or allows no token at all; so is a mask for a slot this step does not sample.
3. The result is a new float32 tensor; the input logits are not written.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def mask_bytes(vocab: int) -> int:
    """Bytes of one mask over `vocab` logits: whole int32 words."""
    return 4 * ((vocab + 31) // 32)


def check_mask(slot: int, mask: bytes, vocab: int) -> None:
    """Rule 2 for one mask (host-side, no device work)."""
    if not isinstance(mask, (bytes, bytearray, memoryview)):
        raise ValueError(f"slot {slot}: a grammar mask must be bytes, got {type(mask).__name__}")
    want = mask_bytes(vocab)
    if len(mask) != want:
        raise ValueError(f"slot {slot}: its grammar mask has {len(mask)} bytes, a vocabulary of {vocab} needs {want}")
    tail = vocab % 32
    if tail and int.from_bytes(bytes(mask[-4:]), "little") >> tail:
        raise ValueError(f"slot {slot}: its grammar mask allows token ids past the vocabulary ({vocab})")
    if bytes(mask).count(0) == len(mask):
        raise ValueError(f"slot {slot}: its grammar mask allows no token")


def unpack(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [R, vocab] from uint8 [R, 4W] packed masks (bit t % 8 of byte t // 8 is token t)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # [R, 4W, 8]
    return bits.reshape(packed.shape[0], -1)[:, :vocab].bool()


def apply_masks(logits: torch.Tensor, slots: Sequence[int], masks: Mapping[int, bytes]) -> torch.Tensor:
    """`logits` [B, V] (row b belongs to slots[b]) with each slot's mask applied (rules 1-3)."""
    if logits.dim() != 2 or logits.shape[0] != len(slots):
        raise ValueError(f"logits shape {tuple(logits.shape)} does not hold one row per slot ({len(slots)})")
    vocab = logits.shape[1]
    unknown = sorted(set(masks) - set(slots))
    if unknown:
        raise ValueError(f"grammar masks for slots {unknown}, which sample nothing in this step")
    rows = [b for b, s in enumerate(slots) if s in masks]
    x = logits.float()
    if not rows:
        return x.clone()
    for b in rows:
        check_mask(slots[b], masks[slots[b]], vocab)
    host = torch.frombuffer(bytearray(b"".join(bytes(masks[slots[b]]) for b in rows)), dtype=torch.uint8)
    allowed = torch.ones(x.shape, dtype=torch.bool, device=x.device)
    allowed[torch.tensor(rows, dtype=torch.long, device=x.device)] = unpack(host.view(len(rows), -1).to(x.device),
                                                                            vocab)
    return x.masked_fill(~allowed, -torch.inf)
