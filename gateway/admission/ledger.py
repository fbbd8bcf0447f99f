"""KV capacity and the block ledger.

Capacity is counted in the engine's KV blocks. It comes from the engine itself
(``vllm:cache_config_info``: ``num_gpu_blocks`` and ``block_size``) or, when the engine does not
publish it, from ``--kv-blocks`` / ``--kv-tokens`` with ``--block-size`` (16, vLLM's GPU default, when
that is unset too).

The ledger counts the blocks reserved by admitted requests. Each reservation is an upper bound of what
the request can ever allocate, so keeping the committed total within ``kv_target x capacity`` means the
engine can never run out of blocks for the gateway's requests, even if every one runs to ``max_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.admission.prefix import shareable_blocks
from gateway.config import Settings
from gateway.engine.live import EngineSnapshot
from gateway.engine.vllm_api.defaults import DEFAULT_BLOCK_SIZE
from gateway.errors import KVBudgetExceeded


@dataclass(frozen=True)
class Capacity:
    blocks: int
    block_size: int
    source: str  # "engine" | "flags"

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


def capacity_from(snapshot: EngineSnapshot | None, settings: Settings) -> Capacity | None:
    """The engine's published capacity, else the flags'; None when neither says."""
    if snapshot is not None and snapshot.num_gpu_blocks and snapshot.block_size and snapshot.num_gpu_blocks > 1:
        # vLLM (V1) takes one block out of the pool as its null block before any request runs, and reports
        # KV usage against the rest (vllm/v1/core/block_pool.py: ``null_block = free_block_queue.popleft()``;
        # ``get_usage``: "Subtract 1 to account for null block"). Requests can hold num_gpu_blocks - 1.
        return Capacity(snapshot.num_gpu_blocks - 1, snapshot.block_size, "engine")
    # A block size the engine publishes beats the flag: it is the unit vLLM really allocates in.
    engine_bs = snapshot.block_size if snapshot is not None else None
    block_size = engine_bs or settings.block_size or DEFAULT_BLOCK_SIZE
    if settings.kv_blocks is not None:
        return Capacity(settings.kv_blocks, block_size, "flags")
    if settings.kv_tokens is not None:
        # A partial block cannot hold a sequence's tokens, so round down.
        blocks = settings.kv_tokens // block_size
        return Capacity(blocks, block_size, "flags") if blocks > 0 else None
    return None


def budget_blocks(cap: Capacity, kv_target: float) -> int:
    """The budget ``B = floor(kv_target x capacity)`` the ledger keeps the committed total within."""
    # The epsilon keeps 0.3 x 10 from flooring to 2.
    return math.floor(kv_target * cap.blocks + 1e-9)


def too_large_message(prompt_tokens: int, max_tokens: int, n: int, need: int, cap: Capacity, kv_target: float) -> str:
    """Why a request that needs more than the whole budget is refused, with both numbers."""
    budget = budget_blocks(cap, kv_target)
    return (
        f"This request needs {need} KV blocks ({need * cap.block_size} tokens: n={n} x "
        f"({prompt_tokens} prompt + {max_tokens} max_tokens) in blocks of {cap.block_size}), more than "
        f"the engine's whole KV budget of {budget} blocks ({budget * cap.block_size} tokens = "
        f"kv_target {kv_target:g} x {cap.blocks} blocks). Lower max_tokens, n or the prompt."
    )


def fit_output(
    prompt_tokens: int, max_tokens: int, n: int, cap: Capacity, kv_target: float, *, clamp: bool, shared: bool
) -> int:
    """``max_tokens`` if the request fits the whole budget; with ``clamp``, lowered until it does. ``shared``: its
    ``n`` sequences hold their shareable prompt blocks once. Raises ``KVBudgetExceeded`` when it cannot fit."""
    budget = budget_blocks(cap, kv_target)
    bs = cap.block_size
    common = shareable_blocks(prompt_tokens, bs) if shared else 0
    need = common + own_blocks(prompt_tokens, max_tokens, n, bs, common)
    if need <= budget:
        return max_tokens
    if clamp:
        per_sequence = (budget - common) // n + common
        fitted = min(max_tokens, per_sequence * bs - prompt_tokens)
        if fitted >= 1:
            return fitted
    raise KVBudgetExceeded(too_large_message(prompt_tokens, max_tokens, n, need, cap, kv_target))


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` tokens (ceil)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if tokens <= 0:
        return 0
    return -(-tokens // block_size)


def request_need(prompt_tokens: int, max_tokens: int, n: int, block_size: int) -> int:
    """Most blocks a request can make the engine allocate: ``n x ceil((prompt + max_tokens) / block_size)``.

    Each of the ``n`` sequences holds its prompt and its output in one run of blocks, so rounding is
    once per sequence over prompt plus output. The prompt is counted once per sequence: vLLM shares
    prompt blocks between the ``n`` sequences only through prefix caching, and only for full blocks
    already computed, so sharing cannot be relied on; live usage lets the adaptive policy profit from
    it when it happens. The one-token slack (the last sampled token is never written to the cache) is
    kept as margin.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    return n * blocks_for(max(0, prompt_tokens) + max(0, max_tokens), block_size)


def own_blocks(prompt_tokens: int, max_tokens: int, n: int, block_size: int, shared: int = 0) -> int:
    """Most blocks the ``n`` sequences can allocate beyond ``shared`` prompt blocks they hold in common.

    With prefix sharing the first ``shared`` full blocks of the prompt are held once for the whole request
    (and for every other request with the same prefix); each sequence still holds the rest of its prompt (the
    block with the last prompt token is never shared) and its output. ``shared = 0`` is ``request_need``."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    per_sequence = blocks_for(max(0, prompt_tokens) + max(0, max_tokens), block_size)
    return n * max(0, per_sequence - shared)


def blocks_in_use_at_least(prompt_tokens: int, generated: int, n: int, block_size: int, shared: int = 0) -> int:
    """A lower bound of the blocks a running request holds after ``generated`` tokens over all its
    sequences, beyond ``shared`` common prompt blocks: each sequence holds the rest of its prompt's blocks, and
    all together hold every token past the shared ones (each sequence's own blocks start at a block boundary)."""
    tail = max(0, prompt_tokens - shared * block_size)
    per_sequence = n * blocks_for(tail, block_size)
    together = blocks_for(n * tail + max(0, generated), block_size)
    return max(per_sequence, together)


class Ledger:
    """Blocks each request in flight holds on its own (with prefix sharing, its shared prompt blocks are in
    ``sharing.SharedBlocks``). Never negative: a release without its commit is a bug."""

    def __init__(self) -> None:
        self._committed = 0
        self._entries = 0

    @property
    def committed(self) -> int:
        return self._committed

    @property
    def in_flight(self) -> int:
        """Entries committed and not yet released."""
        return self._entries

    def commit(self, blocks: int) -> None:
        if blocks < 0:
            raise ValueError(f"cannot commit a negative number of blocks ({blocks})")
        self._committed += blocks
        self._entries += 1

    def release(self, blocks: int) -> None:
        if blocks < 0 or blocks > self._committed or self._entries == 0:
            raise ValueError(
                f"release of {blocks} blocks does not match the ledger "
                f"({self._committed} blocks in {self._entries} entries)"
            )
        self._committed -= blocks
        self._entries -= 1

    def resize(self, old_blocks: int, new_blocks: int) -> None:
        """Change one entry's size, e.g. when the engine's block size becomes known."""
        if old_blocks > self._committed or new_blocks < 0:
            raise ValueError(f"cannot resize an entry of {old_blocks} blocks to {new_blocks}")
        self._committed += new_blocks - old_blocks
