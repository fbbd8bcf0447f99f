"""The vLLM simulator's KV block pool with prefix caching, as vLLM 0.32's V1 ``BlockPool`` keeps it.

- A block's key chains its ``block_size`` token ids to the key of the block before it, with the extra keys of
  ``generate_block_hash_extra_keys``: ``("lora", name, path)`` on every block of a LoRA request and
  ``("cache_salt", salt)`` on the first block only. Only full blocks get a key.
- Free blocks wait in one queue, the next to be handed out first. A freed block without a key goes to the
  front (reused first), a freed block with a key to the back (evicted last), so cached blocks are evicted in
  the order they were freed. Handing out a cached block evicts it: its key stops being findable.
- A lookup takes the longest run of cached blocks from the start; taking a hit that sits in the free queue
  removes it from the queue (``touch``). Two blocks may hold the same key (vLLM does not deduplicate); a
  lookup finds the one cached first.

Blocks never handed out cost nothing, so a pool of a million blocks is free until used.
``KvCache`` holds the sequences' blocks over the pool as vLLM's ``KVCacheManager`` does: lookups, allocation
as a step is scheduled, caching of the blocks the scheduled tokens fill, release.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .types import Sequence as Seq


def extra_keys(block_index: int, lora: tuple[str, str] | None, cache_salt: str | None) -> tuple[Any, ...] | None:
    """vLLM's extra keys of one block: the LoRA adapter on every block, the salt on the first only."""
    keys: list[Any] = []
    if lora is not None:
        keys.append(("lora", *lora))
    if cache_salt and block_index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def block_key(parent: int | None, tokens: tuple[int, ...], extra: tuple[Any, ...] | None) -> int:
    """The key of a full block (vLLM's ``hash_block_tokens``; a 64-bit hash stands in for sha256)."""
    return hash((parent, tokens, extra))


class _Queue:
    """A FIFO of block ids that can also drop any member. An array of ints holds them, which the garbage
    collector does not walk; dropped members stay in it until they reach the head (or a compaction)."""

    def __init__(self) -> None:
        self._ids = array("q")
        self._head = 0
        self._shift = 0  # positions of the entries dropped by compactions
        self._position: dict[int, int] = {}  # each member's position: where it was appended

    def __len__(self) -> int:
        return len(self._position)

    def append(self, block: int) -> None:
        if len(self._ids) > 2 * len(self._position) + 1024:  # mostly popped or dropped entries: amortised O(1)
            self._compact()
        self._position[block] = self._shift + len(self._ids)
        self._ids.append(block)

    def remove(self, block: int) -> None:
        del self._position[block]

    def popleft(self) -> int:
        while True:
            block = self._ids[self._head]
            position = self._shift + self._head
            self._head += 1
            if self._position.get(block) == position:
                del self._position[block]
                return block

    def _compact(self) -> None:
        live = array("q", (b for i, b in enumerate(self._ids[self._head:], self._shift + self._head)
                           if self._position.get(b) == i))
        self._shift += len(self._ids)
        self._position = {b: self._shift + i for i, b in enumerate(live)}
        self._ids, self._head = live, 0


class BlockPool:
    """``num_blocks`` blocks that requests can hold (vLLM's null block is not among them), named by their ids.

    Blocks are plain ints, the tables dicts of ints and the queues arrays, none of which the garbage collector
    walks: a cache of a million blocks costs memory, not collection pauses.
    """

    def __init__(self, num_blocks: int, caching: bool) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        # The free queue is _front, then the blocks never handed out (ids _next_new..num_blocks-1), then _back:
        # prepends go before everything and appends after everything, so the three parts stay in that order.
        # Only blocks without a key are prepended and only cached ones hit, so _front is a stack (its end is
        # the head of the queue) and only _back loses members other than its head.
        self._front = array("q")
        self._back = _Queue()
        self._next_new = 0
        self._refs: dict[int, int] = {}  # blocks held, and by how many sequences
        self._key_of: dict[int, int] = {}  # cached blocks' keys
        # Each key's holder cached first, and any later holders of the same key in the order they were cached.
        self._holder: dict[int, int] = {}
        self._more_holders: dict[int, list[int]] = {}

    @property
    def free(self) -> int:
        """Blocks with no holder, cached ones included: what vLLM's usage counts as free."""
        return len(self._front) + (self.num_blocks - self._next_new) + len(self._back)

    @property
    def used(self) -> int:
        return len(self._refs)

    @property
    def cached_blocks(self) -> int:
        return len(self._key_of)

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def lookup(self, keys: Sequence[int]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys`` (``find_longest_cache_hit``)."""
        hits: list[int] = []
        for key in keys:
            block = self._holder.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def evictable(self, blocks: Iterable[int]) -> int:
        """Hits that sit in the free queue: taking them uses up free blocks too."""
        return sum(block not in self._refs for block in blocks)

    def touch(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            refs = self._refs.get(block, 0)
            if refs == 0:
                self._back.remove(block)
            self._refs[block] = refs + 1

    def take(self, count: int) -> list[int]:
        """``count`` blocks from the head of the free queue, evicting the cached ones among them."""
        if count > self.free:
            raise ValueError(f"cannot take {count} blocks: {self.free} are free")
        taken: list[int] = []
        for _ in range(count):
            if self._front:
                block = self._front.pop()
            elif self._next_new < self.num_blocks:
                block = self._next_new
                self._next_new += 1
            else:
                block = self._back.popleft()
            if block in self._key_of:
                self._evict(block)
            self._refs[block] = 1
            taken.append(block)
        return taken

    def cache(self, blocks: Sequence[int], keys: Sequence[int], start: int, end: int) -> None:
        """Make ``blocks[start:end]`` (full now) findable under ``keys[start:end]`` (``cache_full_blocks``)."""
        for i in range(start, end):
            block, key = blocks[i], keys[i]
            if block in self._key_of:
                continue  # a hit: cached already
            self._key_of[block] = key
            if key in self._holder:
                self._more_holders.setdefault(key, []).append(block)
            else:
                self._holder[key] = block

    def release(self, blocks: Sequence[int]) -> None:
        """A request lets go of its blocks; the tail goes first so it is evicted first (``free_blocks``)."""
        first: list[int] = []
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            if block in self._key_of:
                self._back.append(block)
            else:
                first.append(block)
        # The tail at the very head of the queue: pushed last.
        self._front.extend(reversed(first))

    def _evict(self, block: int) -> None:
        key = self._key_of.pop(block)
        more = self._more_holders.get(key)
        if self._holder[key] == block:
            if more:
                self._holder[key] = more.pop(0)
            else:
                del self._holder[key]
        else:
            assert more is not None
            more.remove(block)
        if more is not None and not more:
            del self._more_holders[key]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KvCache:
    """The blocks of the engine's sequences: what they find cached, hold and leave cached."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.pool = BlockPool(num_blocks, caching)
        self.block_size = block_size
        self.caching = caching
        self.peak_used = 0

    def keys(self, seq: Seq, count: int) -> list[int]:
        """The sequence's block keys, computed (once: they stay on the sequence) at least for its first ``count``
        full blocks."""
        keys = seq.keys
        bs = self.block_size
        prompt = seq.prompt
        while len(keys) < count:
            i = len(keys)
            extra = extra_keys(i, prompt.lora, prompt.cache_salt)
            keys.append(block_key(keys[-1] if keys else None, _tokens(seq, i * bs, (i + 1) * bs), extra))
        return keys

    def hits(self, seq: Seq, tokens: int) -> list[int]:
        """The cached blocks of the longest prefix of the sequence's first ``tokens - 1`` tokens."""
        if not self.caching:
            return []
        count = (tokens - 1) // self.block_size
        return self.pool.lookup(self.keys(seq, count)[:count])

    def grow(self, seq: Seq, tokens: int) -> None:
        """Slots for the sequence's first ``tokens`` tokens; the blocks they fill are cached."""
        missing = _ceil_div(tokens, self.block_size) - len(seq.blocks)
        if missing > 0:
            seq.blocks += self.pool.take(missing)
            self.peak_used = max(self.peak_used, self.pool.used)
        full = tokens // self.block_size
        if self.caching and full > seq.cached_blocks:
            self.pool.cache(seq.blocks, self.keys(seq, full), seq.cached_blocks, full)
            seq.cached_blocks = full

    def growth(self, seq: Seq, tokens: int) -> int:
        """Blocks a running sequence must take to hold ``tokens`` tokens."""
        return _ceil_div(tokens, self.block_size) - len(seq.blocks)

    def admit(self, seq: Seq, reserve: int = 0) -> int | None:
        """Give a waiting sequence its cached prefix and blocks for the rest, and return the tokens it found
        cached; None (nothing changed) when the free blocks do not suffice or would leave fewer than
        ``reserve`` free."""
        tokens = seq.prompt_tokens + seq.generated
        hits = self.hits(seq, tokens)
        if self.growth(seq, tokens) - len(hits) + self.pool.evictable(hits) + reserve > self.pool.free:
            return None
        self.pool.touch(hits)
        found = len(hits) * self.block_size
        seq.blocks = hits
        seq.cached_blocks = len(hits)
        self.grow(seq, tokens)
        if seq.cached_tokens is None:
            # vLLM's prefill stats, taken at the first scheduling only.
            seq.cached_tokens = found
            cached_now = seq.cached_blocks * self.block_size
            seq.created_cache_tokens = max(0, min(cached_now, seq.prompt_tokens) - found)
        return found

    def release(self, seq: Seq) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.cached_blocks = 0

    def most_to_finish(self, seqs: Sequence[Seq]) -> int:
        """Free blocks that running ``seqs`` (the waiting sequences of one prompt) to the end takes at most."""
        first = seqs[0]
        bs = self.block_size
        each = _ceil_div(first.prompt_tokens + first.target - 1, bs)
        hits = self.hits(first, first.prompt_tokens)
        need = each - len(hits) + self.pool.evictable(hits)
        if len(seqs) > 1:
            shared = (first.prompt_tokens - 1) // bs if self.caching else 0
            # A sibling may hit an older, freed copy of a block the first one cached anew: one more each.
            need += (len(seqs) - 1) * (each - shared) + max(0, shared - len(hits))
        return need


def _tokens(seq: Seq, start: int, end: int) -> tuple[int, ...]:
    """Token ids ``start:end`` of a sequence: its prompt's, then its generated tokens' (counting down)."""
    ids = seq.prompt.ids
    prompt = len(ids)
    if end <= prompt:
        return tuple(ids[start:end])
    first_output = max(start, prompt) - prompt
    return (*ids[start:prompt], *range(seq.output_base - first_output, seq.output_base - (end - prompt), -1))
