"""The realistic chat traffic (Poisson arrivals, prompt sizes, true answer lengths), each request's outcome and a
run's figures. Nothing here does I/O; the clients that send it are in ``bench.workloads.realistic_clients``.

A run's traffic is one plan of arrivals and lengths; every target of the run gets the same plan with words of its
own (``prompt``), so no target finds another's prompts in the prefix cache.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from testing.vllm_sim.engine import TINY_EOS_P, TINY_OTHER_STOP_P

MAX_TOKENS = 1024
MEAN_LENGTH = 200.0
SIGMA = 0.8
MIN_WORDS, MAX_WORDS = 150, 400
REFUSED = frozenset({429, 503})

# Words of one or two tokens each in the tiny model's tokenizer (counted when the list was made): 400 of them
# make at most ~660 prompt tokens, which leaves room for max_tokens 1024 in the 2,048-token context.
WORDS = (
    "a", "an", "and", "answer", "answered", "answers", "are", "arguments", "as", "assistant", "at", "before", "but",
    "by", "cache", "capital", "card", "content", "dog", "for", "has", "i", "if", "in", "is", "it", "like", "list",
    "main", "model", "models", "name", "never", "of", "ok", "on", "once", "one", "or", "out", "over", "prompt",
    "ran", "role", "run", "say", "some", "step", "text", "than", "that", "the", "them", "there", "three", "time",
    "to", "token", "tokens", "too", "tool", "tools", "up", "upon", "user", "was", "with", "word", "work",
)


@dataclass(frozen=True)
class Mix:
    """A distribution of prompts and answers: prompt sizes uniform in words, answers' mean lengths lognormal
    (``lognormal_length``), and the ``max_tokens`` every request asks for."""

    min_words: int
    max_words: int
    mean_length: float
    max_tokens: int


# ``chat``: the first distribution (150-400 words, answers around 200 tokens). ``long``: the grid's second, longer
# prompts and shorter answers (500-850 words, 830-1,390 prompt tokens; answers around 60 tokens), as RAG or
# summarising traffic is; its 850 words and max_tokens 512 fit the 2,048-token context (a test counts them).
MIXES = {"chat": Mix(MIN_WORDS, MAX_WORDS, MEAN_LENGTH, MAX_TOKENS), "long": Mix(500, 850, 60.0, 512)}


@dataclass(frozen=True)
class Planned:
    """One request of a run: when it arrives (s after the start), its prompt's words, and the answer's mean
    length (tokens): the engine draws the real one, geometric around it (``length_body``), which nobody knows
    in advance; and the ``max_tokens`` it asks for."""

    at: float
    words: int
    length: int
    max_tokens: int = MAX_TOKENS


def lognormal_length(rng: random.Random, mean: float = MEAN_LENGTH, sigma: float = SIGMA,
                     cap: int = MAX_TOKENS) -> int:
    """An answer length: lognormal with this mean (and sigma of the log), at least 1, at most ``cap``."""
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


def plan(rate: float, duration_s: float, seed: int, mix: Mix = MIXES["chat"]) -> list[Planned]:
    """Poisson arrivals at ``rate`` a second for ``duration_s`` seconds, each with its prompt size and length
    drawn from ``mix``."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    rng = random.Random(seed)
    out: list[Planned] = []
    at = rng.expovariate(rate)
    while at < duration_s:
        words = rng.randint(mix.min_words, mix.max_words)
        length = lognormal_length(rng, mix.mean_length, cap=mix.max_tokens)
        out.append(Planned(at, words, length, mix.max_tokens))
        at += rng.expovariate(rate)
    return out


def prompt(planned: Planned, index: int, seed: int, target: int) -> str:
    """The words of request ``index`` for ``target``: as many as planned, drawn apart for each target."""
    rng = random.Random(f"{seed}:{target}:{index}")
    return " ".join(rng.choice(WORDS) for _ in range(planned.words))


def length_body(length: int, eos_id: int) -> dict[str, object]:
    """What makes the tiny random-weight model's answer run ``length`` tokens on average, in a way the gateway
    cannot read: a logit bias on EOS alone, so that each token ends the answer with the chance ``1 / length``
    (its lengths geometric around ``length``; the plan's lognormal lengths make them a mixture with a mean near
    200). ``min_tokens`` would tell the gateway the length, and it books what requests declare. Past about 550
    tokens the model's other stop token ends it first whatever the bias: those answers run ~480 on average."""
    return {"logit_bias": {str(eos_id): eos_bias(length)}}


def eos_bias(length: float) -> float:
    """The logit bias on the tiny model's EOS that makes a token end the answer with the chance ``1 / length``
    (``stop_chance`` inverted; -100 where its other stop token alone ends answers sooner on average)."""
    chance = 1.0 / max(1.0, length)
    if chance >= 1.0:
        return 100.0
    eos = (chance * (1.0 - TINY_EOS_P) - TINY_OTHER_STOP_P) / (1.0 - chance)
    return -100.0 if eos <= 0 else round(max(-100.0, min(100.0, math.log(eos / TINY_EOS_P))), 3)


@dataclass(frozen=True)
class Outcome:
    """What the client saw of one request; times in seconds since the run's start."""

    at: float
    status: int | None  # None: no response (a timeout or a transport error)
    ttft: float | None  # from sending to the first streamed event
    tokens: int
    end: float
    timed_out: bool = False
    error: str = ""  # what went wrong, for the log
    # For joining the gateway's access log (the aiohttp client only): its x-request-id, and the wall-clock times
    # of the send and of the first event read.
    request_id: str = ""
    sent_wall: float = 0.0
    first_wall: float = 0.0

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.tokens > 0 and not self.timed_out


@dataclass(frozen=True)
class Figures:
    """One target's run: output tokens/s, TTFT (s), goodput (completed within the objective, a second) and the
    counts the table sums."""

    tokens_per_s: float
    mean_ttft: float
    p99_ttft: float
    goodput: float
    completed: int
    within: int  # completed within the objective
    refused: int
    timeouts: int
    failed: int
    preemptions: float = 0.0
    refusal_p99_ms: float = math.nan  # from sending to the refusal's answer
    engine_cpu_s: float = 0.0  # CPU time of the engine's processes during the run
    gateway_cpu_s: float = 0.0  # and of the gateway's (0 for direct targets)
    client_cpu_s: float = 0.0  # and of the client (the benchmark's own process)
    wall_s: float = 0.0  # from the start to the last answer

    @property
    def cores_busy(self) -> float:
        """The three together over the run's wall time: near the machine's cores, the run was CPU-bound, and what
        one of them takes the others did not get."""
        return (self.engine_cpu_s + self.gateway_cpu_s + self.client_cpu_s) / self.wall_s if self.wall_s else 0.0

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        """The harness's figures of the run, each key after ``prefix``."""
        tokens = self.tokens_per_s * self.wall_s
        out = {
            "tokens_per_s": self.tokens_per_s, "mean_ttft": self.mean_ttft, "p99_ttft": self.p99_ttft,
            "goodput": self.goodput, "within_pct": 100.0 * self.within / self.completed if self.completed else math.nan,
            "completed": float(self.completed), "preemptions": self.preemptions, "refused": float(self.refused),
            "refusal_p99_ms": self.refusal_p99_ms, "timeouts": float(self.timeouts), "failed": float(self.failed),
            "engine_cpu_s": self.engine_cpu_s, "gateway_cpu_s": self.gateway_cpu_s, "client_cpu_s": self.client_cpu_s,
            "gateway_cpu_us_token": 1e6 * self.gateway_cpu_s / tokens if tokens and self.gateway_cpu_s else math.nan,
            "cores_busy": self.cores_busy,
        }  # fmt: skip
        return {prefix + k: v for k, v in out.items()}


def nearest_rank(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def figures(outcomes: Sequence[Outcome], objective: float, preemptions: float = 0.0,
            cpu: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> Figures:
    """A run's figures; its duration runs from the start to the last answer, refusal or timeout."""
    wall = max((o.end for o in outcomes), default=0.0)
    done = [o for o in outcomes if o.completed]
    ttfts = [o.ttft for o in done if o.ttft is not None]
    within = sum(1 for t in ttfts if t <= objective)
    refusals = [1000 * (o.end - o.at) for o in outcomes if o.status in REFUSED]
    refused = len(refusals)
    timeouts = sum(1 for o in outcomes if o.timed_out)
    return Figures(
        tokens_per_s=sum(o.tokens for o in done) / wall if wall else 0.0,
        mean_ttft=statistics.fmean(ttfts) if ttfts else math.nan,
        p99_ttft=nearest_rank(ttfts, 0.99),
        goodput=within / wall if wall else 0.0,
        completed=len(done), within=within, refused=refused, timeouts=timeouts,
        failed=len(outcomes) - len(done) - refused - timeouts, preemptions=preemptions,
        refusal_p99_ms=nearest_rank(refusals, 0.99), engine_cpu_s=cpu[0], gateway_cpu_s=cpu[1],
        client_cpu_s=cpu[2], wall_s=wall,
    )


def capacity(mean_ttft_by_rate: Mapping[float, float], bound: float = 1.0) -> float | None:
    """The highest rate whose mean TTFT stayed under ``bound``, every lower rate's too (None: not even the
    lowest)."""
    best = None
    for rate in sorted(mean_ttft_by_rate):
        if not mean_ttft_by_rate[rate] < bound:
            break
        best = rate
    return best
