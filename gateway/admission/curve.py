"""The default policy's projection: the KV usage the admitted requests are expected to hold over the tokens to come.

Booking every request in flight at its expected *final* size counts them all at their largest at once, but they
end at different times: on chat traffic (answers of mean 200 tokens asked 1,024) that held about a fifth of the
engine's cache back at capacity and queued what vLLM would have run at once. The projection is instead a curve
over the next tokens (``OFFSETS``; every running sequence generates one token a step): a request that has
generated ``g`` tokens per sequence is still running ``s`` tokens later with probability ``p = P(L > g + s | L >
g)`` (the lengths seen, ``lengths.OutputLengths.survival``) and then holds ``size(g + s)`` blocks (its prompt and
output so far; its shared prefix blocks stay); once ended it holds nothing. Between two offsets it is counted at
the larger size with the chance it had at the earlier one. So each request adds a mean ``p x size`` and a
variance ``p (1 - p) size^2``, and admission keeps the peak over the offsets of ``level + z x sqrt(variance)``
within the budget, ``z`` being the booking quantile's normal score that the preemption controller sets
(``budget``). At the worst case (quantile 1) every request holds its full size from now on: the ledger corrected
by live usage, as strict with live usage would book.

``level`` is the smaller of two bounds, as with one point in time before:

- ``live_used + sum of (mean(r, s) - credited(r))``: what the engine holds now (``kv_cache_usage_perc``), each
  request's change past the blocks it surely held when that was measured (``credited``: only a request seen
  making progress shortly before; one not yet scheduled, or preempted, is counted whole), plus the shared prompt
  blocks that no request seen running holds and no request in flight counts in its own blocks;
- ``max(live_used, shared_held + sum of (mean(r, s) - prefix_blocks(r)))``: their sizes together, never below
  what the engine holds now, so that a request whose progress is unknown is not counted twice.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from gateway.admission.ledger import blocks_in_use_at_least, own_blocks
from gateway.admission.projection import Booked, Outlook

# Offsets in tokens: fine where the peak usually is (the population in flight grows for a few blocks' worth of
# tokens, then its short answers end), coarse further out. Each request is evaluated up to its own max_tokens.
OFFSETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass
class RequestCurve:
    """One request's expected blocks and their variance at each offset, and its full size (its worst case)."""

    mean: list[float]
    var: list[float]
    full: int


def request_curve(r: Booked, block_size: int, outlook: Outlook) -> RequestCurve:
    """At offset ``s_i``: the blocks at ``g + s_i`` tokens if still running at ``g + s_(i-1)``, the most it may
    hold anywhere between the two offsets (a request that crosses a block boundary and then ends is counted)."""
    per_sequence = math.ceil(r.generated / r.n)
    alive = _survival(r, outlook, per_sequence)
    prompt, n, shared, prefix, cap = r.prompt_tokens, r.n, r.shared_blocks, r.prefix_blocks, r.max_tokens
    full = prefix + own_blocks(prompt, cap, n, block_size, shared)
    mean: list[float] = []
    var: list[float] = []
    size = 0
    p = 1.0
    prompt = max(0, prompt)
    for i, s in enumerate(OFFSETS):
        if i > 0:
            p = 1.0 if alive is None else alive[i - 1]
            if p <= 0.0 or per_sequence + OFFSETS[i - 1] >= cap:
                # Ended, or at its full size from here on: the rest of the curve is this point's.
                rest = len(OFFSETS) - i
                mean.extend([p * size] * rest)
                var.extend([p * (1 - p) * size * size] * rest)
                break
        # ``own_blocks(prompt, min(cap, per_sequence + s), n, block_size, shared)``, inlined: this loop runs for
        # every request in flight on every pass over the queue (a fifth of the gateway's loop at 48 streams/s).
        tokens = prompt + max(0, min(cap, per_sequence + s))
        size = prefix + n * max(0, -(-tokens // block_size) - shared)
        mean.append(p * size)
        var.append(p * (1 - p) * size * size)
    return RequestCurve(mean, var, full)


def _survival(r: Booked, outlook: Outlook, per_sequence: int) -> list[float] | None:
    """P(still running at each offset); None: the worst case, running to ``max_tokens`` and holding it."""
    if outlook.quantile >= 1.0 or outlook.lengths is None:
        return None
    return outlook.lengths.survival(r.family, r.tenant, r.max_tokens, per_sequence, OFFSETS, r.min_output)


def credited_blocks(r: Booked, block_size: int) -> int:
    """The blocks a snapshot surely holds of ``r``: none unless it was seen running."""
    if r.credited is None:
        return 0
    # Seen running: the shared prompt blocks it booked are in the engine too (held by it or a sharer).
    return r.prefix_blocks + blocks_in_use_at_least(r.prompt_tokens, r.credited, r.n, block_size, r.shared_blocks)


@dataclass
class UsageCurve:
    """The projected usage of the requests in flight at each offset, its variance, and the worst case: every
    request at its full size (what the spread never takes the projection past)."""

    level: list[float]
    var: list[float]
    worst: float
    z: float | None  # None: the worst case, no spread

    def peak(self, extra: RequestCurve | None = None) -> float:
        """The most the usage is projected to reach, ``extra`` admitted too."""
        z = self.z or 0.0
        if extra is None:
            spread = max(lv + z * math.sqrt(v) for lv, v in zip(self.level, self.var, strict=True))
            return min(spread, self.worst)
        spread = max(
            lv + m + z * math.sqrt(v + ev)
            for lv, v, m, ev in zip(self.level, self.var, extra.mean, extra.var, strict=True)
        )
        return min(spread, self.worst + extra.full)

    def add(self, extra: RequestCurve) -> None:
        self.level = [lv + m for lv, m in zip(self.level, extra.mean, strict=True)]
        self.var = [v + ev for v, ev in zip(self.var, extra.var, strict=True)]
        self.worst += extra.full


def usage_curve(
    live_used: int, in_flight: Iterable[Booked], block_size: int, outlook: Outlook, shared_held: int = 0,
    *, engine: tuple[int, float] | None = None, transit: float = 1.0,
) -> UsageCurve:
    """Where the requests in flight take the engine's usage over the tokens to come. ``shared_held``: the shared
    prompt blocks the in-flight requests hold together, each once. ``engine``: the sequences the engine held
    (running and waiting) and when that was read; ``transit``: how long a request admitted before that may still
    have been on its way to the engine."""
    in_flight = list(in_flight)
    gone = _left_the_engine(in_flight, engine, transit)
    # The two bounds differ only in what they subtract: one sum of the curves serves both.
    means = [0.0] * len(OFFSETS)
    together_only = [0.0] * len(OFFSETS)  # the requests that left the engine, in the second bound alone
    var = [0.0] * len(OFFSETS)
    credited_total = prefix_total = full_credited = full_total = 0
    seen_keys: set[Hashable] = set()
    added_unseen = 0  # shared blocks added by requests not seen running: in their own curves
    for r in in_flight:
        curve = request_curve(r, block_size, outlook)
        prefix_total += r.prefix_blocks
        full_total += curve.full
        if id(r) in gone:
            # On top of the live usage it adds nothing more; its size still counts among all the sizes together.
            together_only = list(map(operator.add, together_only, curve.mean))
        else:
            credited = credited_blocks(r, block_size)
            means = list(map(operator.add, means, curve.mean))
            credited_total += credited
            full_credited += max(0, curve.full - credited)
            var = list(map(operator.add, var, curve.var))
        if id(r) in gone:
            continue
        if r.credited is not None:
            seen_keys.update(r.keys)
        else:
            added_unseen += r.prefix_blocks
    # Shared blocks whose request that added them has ended, held now only by requests not seen running, are in
    # neither: the usage may predate them, and the engine will hold them again.
    unseen = max(0, shared_held - len(seen_keys) - added_unseen)
    on_top = live_used - credited_total + unseen
    together = shared_held - prefix_total
    level = [
        min(on_top + m, max(float(live_used), together + m + g)) for m, g in zip(means, together_only, strict=True)
    ]
    worst = min(live_used + full_credited + unseen, max(live_used, shared_held + full_total - prefix_total))
    return UsageCurve(level, var, worst, outlook.z)


def _left_the_engine(in_flight: list[Booked], engine: tuple[int, float] | None, transit: float) -> set[int]:
    """Requests surely no longer in the engine: the gateway still relays their streams (vLLM's API server, a
    client or the gateway's own loop running behind) while the engine has ended them. Of the requests admitted
    more than ``transit`` before the engine's count, the engine can hold no more sequences than it reports, seen
    running or not (what the stream shows lags what the engine does): the largest of them are kept up to that
    count, the others have left."""
    if engine is None:
        return set()
    sequences, taken_at = engine
    since = taken_at - transit
    old = [r for r in in_flight if r.admitted_at is not None and r.admitted_at < since]
    if sum(r.n for r in old) <= sequences:
        return set()
    old.sort(key=lambda r: r.blocks, reverse=True)
    kept = 0
    gone: set[int] = set()  # ids: the requests need not be hashable
    for r in old:
        if kept + r.n <= sequences:
            kept += r.n
        else:
            gone.add(id(r))
    return gone
