"""One request as the guard sees it, and what the guard decides for it.

The HTTP layer builds a ``RequestContext`` once (request id, the key's priority, the overflow policy, the body
parsed); the pipeline reads it, plans the request (``Plan``, with the ``Booking`` admission reserves) and records
what it did in ``outcome``; its answer is a ``Reply`` (``exchange``). Nothing here knows HTTP frameworks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.admission.prefix import PromptPrefix
from gateway.config import PromptOverflowPolicy
from gateway.guard.parts import Outcome
from gateway.guard.prompts import Prompt
from gateway.observe.tracing import OFF, RequestTrace


@dataclass(slots=True)
class RequestContext:
    """``route`` names the request's kind (chat, completions, responses, a pooling route); ``path`` is the
    canonical upstream path it goes to."""

    request_id: str
    route: str
    path: str
    body: dict[str, Any]
    priority: int = 0
    prompt_policy: PromptOverflowPolicy = "reject"
    tenant: str = "default"  # from the caller's key (the keys file); "default" for every other caller
    tenant_weight: float = 1.0
    deadline: float | None = None  # seconds the client gives it to a first token, when it says (``deadlines``)
    objective: float | None = None  # seconds to a first token it asks for as an objective (``x-llm-d-slo-ttft-ms``)
    trace_carrier: dict[str, str] = field(default_factory=dict)  # the client's W3C trace headers, if any
    outcome: Outcome = field(init=False)
    trace: RequestTrace = field(init=False, default=OFF)  # the request's spans (no-op while tracing is off)

    def __post_init__(self) -> None:
        self.outcome = Outcome(self.request_id)


@dataclass(frozen=True, slots=True)
class Booking:
    """What a request reserves: ``n`` sequences of ``prompt_tokens`` + ``max_tokens`` tokens each.

    ``min_output``: output tokens per sequence it surely generates (``planning.sure_output``), booked as known.
    ``learns_output``: whether its output length teaches the adaptive policy (a pooling request has none).
    ``prompt_ids``: the ids the engine will schedule, for a request of exactly one prompt whose ids are known
    (not for media parts, batches of prompts or pooling), so its KV blocks can be keyed as the prefix cache keys them.
    """

    prompt_tokens: int
    max_tokens: int
    n: int
    stream: bool = False
    learns_output: bool = True
    prompt_ids: tuple[int, ...] | None = None
    prefix: PromptPrefix | None = None  # what of the prompt admission may book as shared (``prefixes``)
    min_output: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """What the guard decided for one request (``planning``): what admission books for it, and what the engine
    is sent in place of what the client sent (``endpoints.base.engine_body`` writes it); None: the client's
    stands."""

    booking: Booking
    max_tokens: int | None = None  # the output bound sent (generating routes), in every field the client used
    messages: list[dict[str, Any]] | None = None  # chat: the conversation as truncated
    prompts: list[Prompt] | None = None  # completions: the prompts as truncated
    truncate_prompt_tokens: int | None = None  # pooling: the engine's cut of each prompt, asked by the guard
