"""Time-aware booking: the peak of the engine's KV usage over the coming steps, as the requests in flight end in turn.

The books count every request in flight at its full size at once. But a request whose stream the gateway follows
is known to have generated some tokens, so it ends within a known number of engine steps; a request admitted now
starts small (its prompt) and grows one token per step. Where the requests in flight end before the candidate has
grown, the candidate's output blocks can overlap their ends instead of adding to their sizes.

**The model.** Steps are counted from now. A request in flight whose sequences have each surely generated ``done``
tokens (``end_step``) ends by step ``e = max_tokens - done``; until then it is counted at its FULL size, own blocks
and shared prompt blocks; a request whose progress is unknown (not streamed, or too few tokens seen) is counted
at full size over the whole horizon. A shared prompt block is held until the last of its holders ends. The
candidate holds ``n x (ceil((prompt + s) / block_size) - shared)`` own blocks at step ``s`` up to its full size at
``s = max_tokens``, and its shared prompt blocks throughout. It is admitted when the PEAK of the sum fits the
budget. The in-flight part only falls and the candidate's only grows between ends, so the peak is at one of the
ends that come before the candidate's full size, or at its full size: ``peak`` evaluates the sum there, O(in-flight)
per candidate after an O(in-flight + shared blocks) ``Timeline`` built once per pass over the queue.

**Why the requests in flight are counted at full size, not along their own growth curve.** The gateway sees a
stream's tokens after the engine made them, and the lag has no bound (a slow client holds the relay back while vLLM
keeps generating into its output queue). A request the gateway believes at token 100 may already be at its last
block. Counting it along ``ceil((prompt + seen + s) / block_size)`` would put it at its full size too late: with it
at 5 of 10 blocks seen and 9 real, a 1-block candidate growing to 2 blocks projects a peak of 10 where the engine
holds 12. Knowing only a lower bound of each request's progress, "full size until its latest possible end" is the
tightest bound there is (each request may be at its full size at any step before that end). The projection of the
adaptive policy, which is not a guarantee, keeps its own growth estimate.

**Strict keeps its guarantee** (the gateway is the engine's only client, no speculative decoding, one pipeline
stage) under this model:

- *Ends are late, never early.* ``done`` is a lower bound of every sequence's tokens: streamed events may include
  one that carries no token (the chat role chunk per choice, the Responses API's opening events), so
  ``PROGRESS_SLACK`` of them per sequence are not counted; with ``n > 1`` the ``generated`` total is a sum over
  choices, and the slowest choice has at least the total less ``n - 1`` full outputs. The gateway's view lags the
  engine's, so ``done`` is smaller than the truth and the end later. A request that stops early frees early. A
  request not yet scheduled by vLLM has shown no progress: full size over the whole horizon.
- *The candidate never outgrows a request in flight.* vLLM 0.32 schedules the RUNNING requests first, in the order
  they joined ``running``, while its per-step token budget lasts
  (``vllm/v1/core/sched/scheduler.py``, ``schedule``: ``while req_index < len(self.running) and token_budget > 0``),
  and new requests join at the end (``self.running.append(request)`` in the loop over ``waiting``). A request whose
  tokens the gateway saw was running before the candidate was admitted, so it is ahead of the candidate in that
  order. A running request is skipped, for a text decode on one pipeline stage, only when the token budget is spent
  before it (prefill chunks of requests ahead took it), and then every request behind it, the candidate included,
  is skipped too (the ``continue`` cases of that loop concern pipeline parallelism, data-parallel prefill deferral,
  encoder inputs and hybrid-model alignment, which a decode step of a text request does not meet). So a request in
  flight that stalls ends later than projected, but the candidate stalls with it: whenever a request in flight still
  holds blocks, the candidate has advanced at most as many tokens as it, so fewer than its end step ``e``, and the
  engine holds at most the model's sum at the candidate's step, which is within the peak. A candidate whose prefill
  is cut into chunks grows slower still. Speculative decoding breaks this (a sequence may advance several tokens a
  step, each at its own rate): leave time-aware booking off there.
- *No preemption.* While the engine's blocks cover the gateway's requests, vLLM has no reason to preempt one, so
  the order above is not reshuffled (a preempted request would rejoin ``running`` at the end).
- *Each admission keeps the invariant.* Every later admission projects again from the requests in flight then,
  the earlier candidates among them (full size until their progress is seen). The peak is never above the books
  (``committed + need``), so time-aware strict admits whatever strict admits, and more.

vLLM allocates a sequence's slots for ``prompt + k`` tokens in the step that samples its token ``k + 1``, and frees
it after the step that samples its last: the model's one extra token at the full size covers the extra step an
asynchronously scheduled request may hold.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.admission.ledger import blocks_for
from gateway.admission.prefix import BlockKey, leading_run

PROGRESS_SLACK = 16  # streamed events per sequence that may carry no token (role chunk, Responses' opening events)
FOREVER = math.inf  # the end of a request whose progress is unknown


class Timed(Protocol):
    """What the timeline reads of a request, in flight or waiting."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def generated(self) -> int: ...
    @property
    def own_blocks(self) -> int: ...
    @property
    def keys(self) -> tuple[BlockKey, ...]: ...


def surely_done(generated: int, max_tokens: int, n: int) -> int:
    """Tokens each of a request's ``n`` sequences has surely generated, from ``generated`` events over all of them."""
    return generated - (n - 1) * (max_tokens + PROGRESS_SLACK) - PROGRESS_SLACK


def end_step(r: Timed) -> float:
    """The last step at which ``r`` may still hold blocks; ``FOREVER`` while its progress is unknown."""
    done = surely_done(r.generated, r.max_tokens, r.n)
    if done <= 0:
        return FOREVER
    return max(0, r.max_tokens - done)


@dataclass
class Timeline:
    """What the requests in flight hold at each of their end steps. ``held[j]`` is the blocks held at step
    ``ends[j]`` (by every request ending then or later, shared prompt blocks once); ``tail`` what is held after
    the last finite end (the requests of unknown progress); ``key_end`` the step each shared block is held until."""

    ends: list[int]
    held: list[int]
    tail: int
    key_end: dict[BlockKey, float]
    tracked: int  # requests in flight whose end is known

    def held_at(self, step: float) -> int:
        """Blocks the requests in flight hold at ``step``."""
        j = bisect.bisect_left(self.ends, step)
        return self.held[j] if j < len(self.ends) else self.tail

    def add(self, r: Timed) -> None:
        """Count ``r`` in at its full size over the whole horizon (admitted in this pass: no progress yet)."""
        lasts = _key_ends(self.key_end, r.keys)
        for j, step in enumerate(self.ends):
            self.held[j] += r.own_blocks + len(r.keys) - _count_at_least(lasts, step)
        self.tail += r.own_blocks + len(r.keys) - _count_at_least(lasts, FOREVER)
        for key in r.keys:
            self.key_end[key] = FOREVER


def timeline(in_flight: Iterable[Timed]) -> Timeline:
    """The timeline of the requests in flight, as of now."""
    timed = sorted(((end_step(r), r) for r in in_flight), key=lambda pair: pair[0], reverse=True)
    key_end: dict[BlockKey, float] = {}
    freed: dict[float, int] = {}  # blocks no longer held after each end step
    for end, r in timed:
        # Latest end first: a key already seen is held until a later end. Keys chain (``prefix.block_keys``), so
        # the keys seen are a prefix of ``r``'s keys.
        keys = r.keys
        first_new = leading_run(keys, key_end)
        for key in keys[first_new:]:
            key_end[key] = end
        freed[end] = freed.get(end, 0) + r.own_blocks + len(keys) - first_new
    tail = freed.pop(FOREVER, 0)
    ends = sorted(int(e) for e in freed)
    held = [0] * len(ends)
    running = tail
    for j in range(len(ends) - 1, -1, -1):
        running += freed[ends[j]]
        held[j] = running
    tracked = sum(1 for end, _ in timed if end != FOREVER)
    return Timeline(ends, held, tail, key_end, tracked)


def own_at(r: Timed, step: int, block_size: int) -> int:
    """Own blocks a candidate admitted now holds at ``step``: its prompt and ``step`` tokens, up to its full size."""
    tokens = r.prompt_tokens + min(step, r.max_tokens)
    return r.n * max(0, blocks_for(tokens, block_size) - len(r.keys))


def peak(tl: Timeline, r: Timed, block_size: int) -> int:
    """The most blocks the engine holds for the requests in flight and ``r`` admitted now, over the coming steps."""
    full = r.max_tokens
    lasts = _key_ends(tl.key_end, r.keys)  # non-increasing: a key is held at least as long as the keys after it
    shared = len(r.keys)
    best = 0
    held_by_others = len(lasts)  # of r's keys, those a request in flight holds at the step under consideration
    for j, step in enumerate(tl.ends):
        if step >= full:
            break
        while held_by_others and lasts[held_by_others - 1] < step:
            held_by_others -= 1
        best = max(best, tl.held[j] + own_at(r, step, block_size) + shared - held_by_others)
    while held_by_others and lasts[held_by_others - 1] < full:
        held_by_others -= 1
    return max(best, tl.held_at(full) + own_at(r, full, block_size) + shared - held_by_others)


def _key_ends(key_end: dict[BlockKey, float], keys: Sequence[BlockKey]) -> list[float]:
    """The end steps of the held prefix of ``keys``."""
    return [key_end[k] for k in keys[: leading_run(keys, key_end)]]


def _count_at_least(lasts: Sequence[float], step: float) -> int:
    """How many of the non-increasing ``lasts`` are at least ``step``."""
    low, high = 0, len(lasts)
    while low < high:
        mid = (low + high) // 2
        if lasts[mid] >= step:
            low = mid + 1
        else:
            high = mid
    return low


class TimeAware:
    """The policy's time-aware check (``--time-aware``): one timeline per pass over the queue, kept up to date as
    the pass admits."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self._timeline: Timeline | None = None

    def begin_pass(self) -> None:
        """Forget the timeline: progress, the requests in flight or the books moved since the last pass."""
        self._timeline = None

    def fits(self, r: Timed, in_flight: Iterable[Timed], block_size: int, budget: int) -> bool:
        """Whether the peak with ``r`` admitted now stays within ``budget`` (False when off)."""
        if not self.on:
            return False
        if self._timeline is None:
            self._timeline = timeline(in_flight)
        return peak(self._timeline, r, block_size) <= budget

    def admitted(self, r: Timed) -> None:
        """Count ``r``, admitted in the pass under way, into its timeline."""
        if self._timeline is not None:
            self._timeline.add(r)

    def status(self, in_flight: Iterable[Timed], head: Timed | None, block_size: int) -> dict[str, object]:
        """The ``time_aware`` part of ``/guard/status``: the requests in flight whose end is known, the next end,
        and the peak the queue's head would bring if admitted now."""
        if not self.on:
            return {"on": False}
        tl = timeline(in_flight)
        return {
            "on": True,
            "tracked_in_flight": tl.tracked,
            "next_end_step": tl.ends[0] if tl.ends else None,
            "head_peak_blocks": peak(tl, head, block_size) if head is not None else None,
        }
