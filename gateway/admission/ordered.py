"""Floats kept in order under insertions and removals, for a quantile read at any time.

The engine's time to a first token is a quantile over every first token of the last ten seconds
(``deadlines.FirstTokens``): as many values as first tokens a second, times ten. One sorted list moved every value
after the place of each insertion and each removal, so a sample's cost grew with the rate: compiled, a sample with
the window's removals took 1.65 us at 300 first tokens a second, 8.86 us at 3,000 (30,000 values) and 19.68 us at
10,000 (at two workers' 1,300 short chats a second, ~5 us of the authority's ~85 a chat). Here the values are sorted
chunks of at most ``2 * CHUNK``, with each chunk's largest beside them: an insertion or a removal bisects the
chunks' largest values and moves at most one chunk's values, and the ``i``-th value walks the chunks' lengths:
1.25, 1.58 and 2.81 us at the same rates (``python -m bench.workloads.first_tokens``; ``docs/overhead.md``). It
holds and answers what one sorted list would (``tests/unit/admission/test_ordered.py`` checks it against one on
random operations).
"""

from __future__ import annotations

import bisect

CHUNK = 256  # a chunk is split in two past twice this: an insertion moves at most 512 values


class OrderedFloats:
    """A multiset of floats in ascending order: ``add``, ``remove`` one occurrence, ``len`` and the ``i``-th."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self._chunk = max(1, chunk)
        self._chunks: list[list[float]] = []  # each sorted; every value of one <= every value of the next
        self._maxes: list[float] = []  # each chunk's largest value (its last)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def add(self, value: float) -> None:
        chunks, maxes = self._chunks, self._maxes
        if not chunks:
            chunks.append([value])
            maxes.append(value)
            self._len = 1
            return
        i = bisect.bisect_left(maxes, value)  # the first chunk whose largest is not below it
        if i == len(maxes):  # above every value held: at the end of the last chunk
            i -= 1
            chunk = chunks[i]
            chunk.append(value)
            maxes[i] = value
        else:
            chunk = chunks[i]
            bisect.insort(chunk, value)
        self._len += 1
        if len(chunk) > 2 * self._chunk:
            upper = chunk[self._chunk:]
            del chunk[self._chunk:]
            chunks.insert(i + 1, upper)
            maxes[i] = chunk[-1]
            maxes.insert(i + 1, upper[-1])

    def remove(self, value: float) -> None:
        """Take one occurrence of ``value`` out; ``ValueError`` when none is held."""
        chunks, maxes = self._chunks, self._maxes
        i = bisect.bisect_left(maxes, value)  # a value held is in the first chunk whose largest is not below it
        if i < len(maxes):
            chunk = chunks[i]
            j = bisect.bisect_left(chunk, value)
            if j < len(chunk) and chunk[j] == value:
                del chunk[j]
                self._len -= 1
                if not chunk:
                    del chunks[i]
                    del maxes[i]
                else:
                    maxes[i] = chunk[-1]
                return
        raise ValueError(f"{value!r} is not held")

    def at(self, index: int) -> float:
        """The ``index``-th value in order, from 0; ``IndexError`` outside ``0 .. len - 1``."""
        if index < 0 or index >= self._len:
            raise IndexError(f"index {index} of {self._len} values")
        for chunk in self._chunks:
            if index < len(chunk):
                return chunk[index]
            index -= len(chunk)
        raise IndexError(f"index {index} past the chunks")  # unreachable while ``_len`` is their sum

    def values(self) -> list[float]:
        """Every value, in order (a copy)."""
        return [v for chunk in self._chunks for v in chunk]
