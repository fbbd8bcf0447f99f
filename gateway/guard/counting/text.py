"""Exact token ids and counts of text, fast: the text is split at special tokens and each piece's ids are cached.

The tokenizer extracts special tokens before it normalises or pre-tokenizes, so no merge ever crosses one, and
each piece that starts with a special token tokenizes the same alone as in place. A text's ids are therefore its
pieces' ids joined (between the special tokens the tokenizer adds around any text), and are cached by piece
text: a conversation whose earlier turns were tokenized before only pays for its new turns, and pieces not in
the cache are tokenized together in one batch call. Whether a tokenizer has that property is checked against
whole-text tokenization when the counter is built; if not, text is tokenized whole.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

# Bytes the cache holds, counted as Python holds them: each piece's text (1, 2 or 4 bytes a character, by its
# widest character) and its ids, 8 bytes a token, as tuples of the counter's one int object per vocabulary id
# (fresh ints would cost 36 bytes a token; arrays 4, but every read would then create an int object per id
# again, about 0.6 ms for 32K tokens, the time a whole conversation read from the cache takes). A bound in
# characters let 8 MB of emoji (4 bytes a character, 4 tokens each) hold ~80 MB per prompt.
DEFAULT_CACHE_BYTES = 128 * 1024 * 1024
# No single piece takes more than this share of the cache: one huge text would evict every conversation.
LARGEST_PIECE_SHARE = 8
# What an entry costs beyond its text and ids: the ordered dict's node and the tuple's header.
_ENTRY_OVERHEAD = 160
# Encoding 8 MB of emoji (8M tokens) took ~1 GB while it ran (the tokenizer's encodings hold each token's
# string, offsets and masks); freed, it stayed in the allocator's arenas and RSS with it (+1 GB after one such
# prompt, 1.6-1.75 GB after eighteen). After encoding this much text the freed memory goes back to the system.
RELEASE_AFTER_CHARS = 1024 * 1024


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to call
        return None
    return trim


_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Give memory freed inside the allocator back to the system (glibc's ``malloc_trim``; a no-op elsewhere).
    ctypes releases the GIL for the call (0.1-1 s after a huge encoding), which runs in a worker thread."""
    if _TRIM is not None:
        _TRIM(0)

Ids = tuple[int, ...]


class TextCounter:
    """Tokenizes text exactly as ``tokenizer(text, add_special_tokens=...)["input_ids"]``; thread-safe."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        longest: Callable[[], int | None] = lambda: None,
    ) -> None:
        """``longest``: the most tokens a prompt may have (the context), when known; a piece longer than that
        belongs to a prompt that is refused or cut, never sent as it is, so it is not remembered."""
        self.tokenizer = tokenizer
        self._backend: Tokenizer | None = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
        self._cache: OrderedDict[str, tuple[Ids, int]] = OrderedDict()  # piece -> (ids, bytes it costs)
        self._cache_bytes = 0
        self._cache_limit = cache_bytes
        self._longest = longest
        self._lock = threading.Lock()
        self._ints: list[int] = []  # the one int object of each id, shared by the cached pieces
        self._split: re.Pattern[str] | None = None
        self._before: Ids = ()  # the special tokens the tokenizer adds before any text (BOS), and after it
        self._after: Ids = ()
        boundaries = self._boundary_tokens(self._backend) if self._backend is not None else []
        ends = self._special_ends() if boundaries else None
        if boundaries and ends is not None:
            self._before, self._after = ends
            # Split at the tokens the chat template writes (a few suffice, some models define hundreds),
            # and only after checking on probes that ids really join up across them.
            template = str(getattr(tokenizer, "chat_template", None) or "")
            boundaries = sorted(boundaries, key=lambda b: (b not in template, b))[:8]
            self._split = re.compile("|".join(re.escape(b) for b in sorted(boundaries, key=len, reverse=True)))
            if not self._additivity_holds(boundaries):
                self._split = None
        if self._split is not None and self._backend is not None:
            self._ints = list(range(max(self._backend.get_vocab_size(with_added_tokens=True), len(tokenizer))))

    @property
    def splits_at_special_tokens(self) -> bool:
        return self._split is not None

    def _boundary_tokens(self, backend: Tokenizer) -> list[str]:
        if getattr(self.tokenizer, "split_special_tokens", False):
            return []
        boundaries: list[str] = []
        for token_id, added in backend.get_added_tokens_decoder().items():
            # A token that eats whitespace on its left, matches only whole words or on normalized text
            # depends on what precedes it, so a piece starting with it would not tokenize the same alone.
            if not added.special or added.lstrip or added.single_word or added.normalized:
                continue
            if backend.encode(added.content, add_special_tokens=False).ids != [token_id]:
                continue
            boundaries.append(added.content)
        return boundaries

    def _special_ends(self) -> tuple[Ids, Ids] | None:
        """The ids added before and after a text with ``add_special_tokens``, or None if they do not just wrap it."""
        bare = list(self.tokenizer("x y", add_special_tokens=False)["input_ids"])
        full = list(self.tokenizer("x y", add_special_tokens=True)["input_ids"])
        for at in range(len(full) - len(bare) + 1):
            if full[at : at + len(bare)] == bare:
                return tuple(full[:at]), tuple(full[at + len(bare) :])
        return None

    def _additivity_holds(self, specials: list[str]) -> bool:
        samples = ["", "x", " x", "\n\n", "héllo  wörld ", "a\n b", "  ", "1 2", "\t!"]
        probes = ["", " end"]
        for s in specials:
            for before in samples:
                for after in samples:
                    probes.append(f"{before}{s}{after}{s}{after}")
        probes.append("".join(specials) + " end")
        for text in probes:
            for add in (False, True):
                whole = list(self.tokenizer(text, add_special_tokens=add)["input_ids"])
                pieces = self._pieces(text)
                if list(self._join(self._encode(pieces) if pieces else [], add)) != whole:
                    return False
        return True

    def _pieces(self, text: str) -> list[str]:
        if self._split is None:
            return [text]
        starts = [m.start() for m in self._split.finditer(text)]
        if not starts or starts[0] != 0:
            starts.insert(0, 0)
        starts.append(len(text))
        return [text[a:b] for a, b in itertools.pairwise(starts) if b > a]

    def _encode(self, pieces: list[str]) -> list[list[int]]:
        if self._backend is None:
            return [list(self.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in pieces]
        # The batch call skips offsets (3-4x faster than encode) and spreads pieces over the cores.
        ids = [e.ids for e in self._backend.encode_batch_fast(pieces, add_special_tokens=False)]
        if sum(len(p) for p in pieces) >= RELEASE_AFTER_CHARS:
            release_freed_memory()
        return ids

    def _piece_ids(self, pieces: list[str]) -> list[Sequence[int]]:
        """Each piece's ids: from the cache, else tokenized (all missing pieces in one batch) and remembered."""
        found: dict[str, Sequence[int]] = {}
        with self._lock:
            for p in pieces:
                hit = self._cache.get(p)
                if hit is not None:
                    self._cache.move_to_end(p)
                    found[p] = hit[0]
        missing = [p for p in dict.fromkeys(pieces) if p not in found]
        if missing:
            fresh = self._encode(missing)
            found.update(zip(missing, fresh, strict=True))
            self._remember(zip(missing, fresh, strict=True))
        return [found[p] for p in pieces]

    def _join(self, parts: Iterable[Sequence[int]], add_special_tokens: bool) -> Ids:
        out: list[int] = list(self._before) if add_special_tokens else []
        for ids in parts:
            out.extend(ids)
        if add_special_tokens:
            out.extend(self._after)
        return tuple(out)

    def count(self, text: str, add_special_tokens: bool = False) -> int:
        if self._split is None:
            return len(self._whole(text, add_special_tokens))
        total = sum(len(ids) for ids in self._piece_ids(self._pieces(text)))
        return total + (len(self._before) + len(self._after) if add_special_tokens else 0)

    def ids(self, text: str, add_special_tokens: bool = False) -> Ids:
        """The ids of ``text``, as ``tokenizer(text, add_special_tokens=...)["input_ids"]`` gives them."""
        if self._split is None:
            return tuple(self._whole(text, add_special_tokens))
        return self._join(self._piece_ids(self._pieces(text)), add_special_tokens)

    def _whole(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if len(text) >= RELEASE_AFTER_CHARS:
            release_freed_memory()
        return ids

    def _remember(self, items: Iterable[tuple[str, list[int]]]) -> None:
        largest = self._cache_limit // LARGEST_PIECE_SHARE
        longest = self._longest()
        with self._lock:
            for piece, ids in items:
                cost = sys.getsizeof(piece) + 8 * len(ids) + _ENTRY_OVERHEAD
                if cost > largest or (longest is not None and len(ids) > longest) or piece in self._cache:
                    continue
                self._cache[piece] = (self._shared(ids), cost)
                self._cache_bytes += cost
            while self._cache_bytes > self._cache_limit and self._cache:
                _, (_, cost) = self._cache.popitem(last=False)
                self._cache_bytes -= cost

    @property
    def cached_bytes(self) -> int:
        """What the cache holds now, in bytes (as ``_remember`` counts them)."""
        return self._cache_bytes

    def _shared(self, ids: list[int]) -> Ids:
        """``ids`` as a tuple of the counter's own int objects, so that cached pieces hold no ints of their own."""
        try:
            return tuple(itemgetter(*ids)(self._ints)) if len(ids) > 1 else tuple(self._ints[i] for i in ids)
        except IndexError:  # an id beyond the vocabulary the tokenizer reports: keep it as it came
            return tuple(ids)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cache_bytes = 0

    def drop_front(self, text: str, tokens: int) -> str:
        """``text`` without (about) its first ``tokens`` tokens, cut at a token's first character."""
        if tokens <= 0:
            return text
        if self._backend is not None:
            offsets = self._backend.encode(text, add_special_tokens=False).offsets
            return text[offsets[tokens][0] :] if tokens < len(offsets) else ""
        # Slow tokenizers have no offsets: cut by the average characters per token instead.
        n = max(1, self.count(text))
        return text[min(len(text), -(-tokens * len(text) // n)) :]

    def keep_end(self, text: str, tokens: int) -> str:
        """The shortest end of ``text`` whose tokens start ``tokens`` from its end (approximately)."""
        if self._backend is None:
            n = max(1, self.count(text))
            return text[max(0, len(text) - tokens * len(text) // n) :]
        offsets = self._backend.encode(text, add_special_tokens=False).offsets
        if tokens >= len(offsets):
            return text
        return text[offsets[len(offsets) - tokens][0] :] if tokens > 0 else ""
