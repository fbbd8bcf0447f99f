"""A prompt's shareable KV blocks, keyed the way vLLM's prefix cache identifies them.

vLLM (V1) caches a prompt in full blocks of ``block_size`` tokens. A block's hash is its tokens together with the
hash of the block before it and the request's extra keys (``vllm/v1/core/kv_cache_utils.py``:
``hash_block_tokens``, ``generate_block_hash_extra_keys``: the LoRA adapter's name, media hashes, and a
``cache_salt`` on the first block), so equal keys mean equal prefixes under equal conditions. A request reuses
cached blocks only up to its ``prompt length - 1`` tokens (``kv_cache_manager.get_computed_blocks``:
"``max_cache_hit_length = request.num_tokens - 1``": the last prompt token is always computed, to get logits),
so the shareable blocks are the full blocks among the first ``prompt - 1`` tokens; the block holding the last
prompt token, and every block after it, are the sequence's own.

The keys here are BLAKE2b digests: a prompt built to collide with another tenant's prefix would make the ledger
book too little, so the hash must not be one a client can steer (Python's tuple hash can be).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Container, Sequence
from dataclasses import dataclass

BlockKey = bytes
DIGEST_BYTES = 16  # 128 bits: collisions by chance are out of reach, and keys stay small


@dataclass(frozen=True, slots=True)
class PromptPrefix:
    """What prefix sharing needs to know of a prompt: its token ids and what else vLLM puts in its block keys.

    ``salt`` joins every condition that changes vLLM's keys without changing the ids: the model name (a LoRA
    adapter is served under its own name) and the request's ``cache_salt``.
    """

    ids: Sequence[int]
    salt: str = ""


def shareable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Full blocks among the first ``prompt_tokens - 1`` tokens: the most another request's cache hit can cover."""
    if prompt_tokens <= 1 or block_size <= 0:
        return 0
    return (prompt_tokens - 1) // block_size


def block_keys(prefix: PromptPrefix, block_size: int) -> tuple[BlockKey, ...]:
    """The chained keys of the prompt's shareable blocks, first block first."""
    count = shareable_blocks(len(prefix.ids), block_size)
    if count == 0:
        return ()
    parent = hashlib.blake2b(prefix.salt.encode("utf-8", "surrogatepass"), digest_size=DIGEST_BYTES).digest()
    try:
        ids = prefix.ids if isinstance(prefix.ids, array) else array("q", prefix.ids)
    except (OverflowError, TypeError):
        return ()  # not token ids vLLM would accept: it refuses the request; nothing to share
    raw = memoryview(ids).cast("B")
    width = ids.itemsize * block_size
    keys: list[BlockKey] = []
    for i in range(count):
        h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
        h.update(raw[i * width : (i + 1) * width])
        parent = h.digest()
        keys.append(parent)
    return tuple(keys)


def leading_run(keys: Sequence[BlockKey], known: Container[BlockKey]) -> int:
    """How many of ``keys``, from the first, ``known`` holds, for chains where a key implies its predecessors
    (each block's key hashes the one before it): found by bisection."""
    low, high = 0, len(keys)  # keys[:low] known; keys[high:] not
    while low < high:
        mid = (low + high) // 2
        if keys[mid] in known:
            low = mid + 1
        else:
            high = mid
    return low
