"""Deterministic request payloads of known size for the end-to-end suite and the flood benchmark."""

from __future__ import annotations

import random

# Ids of the tiny model's five special tokens (pad, bos, eos, im_start, im_end) come first; prompts
# of ordinary tokens start above them so that no prompt smuggles in an end-of-sequence marker.
FIRST_ORDINARY_ID = 5
VOCAB_SIZE = 512


def token_ids(n: int, seed: int = 0) -> list[int]:
    """``n`` random ordinary token ids; different seeds give prompts that share no prefix."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(n)]


def words(n: int, seed: int = 0) -> str:
    """``n`` space-separated made-up words: at least ``n`` tokens with any byte-level BPE."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(3, 8))) for _ in range(n))
