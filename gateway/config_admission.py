"""Settings of KV admission: the budget, the policy, the queue, the engine's metrics (a part of ``Settings``)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, Field, PositiveFloat

AdmissionPolicyName = Literal["strict", "adaptive"]
PrefixSharing = Literal["auto", "on", "off"]


def _objective(value: object) -> object:
    """``auto``, ``off`` or seconds above 0, in one message when it is none of them (not one per form)."""
    if value in ("auto", "off"):
        return value
    try:
        seconds = float(str(value))
    except ValueError:
        seconds = math.nan
    if 0 < seconds < math.inf:
        return seconds
    raise ValueError(f"auto, off or seconds above 0, got {value!r}")


TtftObjective = Annotated[Literal["auto", "off"] | PositiveFloat, BeforeValidator(_objective)]


class AdmissionFields(BaseModel):
    # -- KV admission -----------------------------------------------------------------------------
    kv_target: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Fraction of the engine's KV blocks the gateway may commit; lower it when clients "
        "bypass the gateway.",
    )
    engine_watermark: float | None = Field(
        None, ge=0.0, lt=1.0, description="The fraction of KV blocks the engine keeps free when it admits a request "
        "beside running ones (vLLM's --watermark): the gateway admits beside requests in flight within the rest, so "
        "that what it admits runs rather than waiting in vLLM's own queue. Default: in managed mode the --watermark "
        "vLLM is started with, else 0.",
    )
    kv_blocks: int | None = Field(
        None, ge=1, description="Engine KV capacity in blocks, when the engine does not publish it."
    )
    kv_tokens: int | None = Field(
        None, ge=1, description="Engine KV capacity in tokens (alternative to --kv-blocks)."
    )
    block_size: int | None = Field(None, ge=1, description="Engine KV block size in tokens, when unpublished.")
    admission_policy: AdmissionPolicyName = Field(
        "adaptive", description="strict: never commit past the ledger; adaptive: use live usage too."
    )
    prefix_sharing: PrefixSharing = Field(
        "auto",
        description="Book prompt blocks shared by requests in flight once, as vLLM's prefix cache holds them: auto "
        "(when the engine reports enable_prefix_caching), on, or off.",
    )
    placement: Literal["prefix", "headroom"] = Field("prefix", description="Which of several engines that can take a "
        "request gets it: prefix (the one holding or lately holding the longest prefix of its prompt, then the one "
        "with the most free blocks) or headroom (the most free blocks only).")
    max_queue: int = Field(1024, ge=0, description="Requests allowed to wait for capacity; more get 429.")
    queue_timeout: float = Field(
        300.0, gt=0, description="Seconds a request may wait in the queue at most before a 503. Long, so that a "
        "burst is served as the engine alone would serve it; under a sustained overload --ttft-objective auto "
        "sheds instead."
    )
    shed_early: Literal["on", "off"] = Field(
        "on", description="on: a queued request forecast to wait past --queue-timeout (from the KV blocks waiting "
        "ahead of it and the rate the engine frees blocks) is refused at once with 503 and that wait as "
        "Retry-After; off: it waits until the timeout."
    )
    preemption_budget: float = Field(
        3.0, ge=0.0, description="Engine preemptions the adaptive policy allows per 100 completed requests: it books "
        "requests at a quantile of the answers' real lengths and backs off towards the worst case while the engine "
        "preempts past this (0: back off on any preemption)."
    )
    ttft_objective: TtftObjective = Field(
        "auto", description="auto: once an overload is sustained (requests keep arriving into a queue that has "
        "held requests longer than the wait below), an arriving request may wait as long as the engine's first "
        "token takes when it is not overloaded (at least 1 s), and one forecast to miss that is refused at once "
        "(503 deadline); a burst that arrives at once is queued whole. SECONDS: every request forecast to get no "
        "first token within this is refused at once, so that admitted requests stay within it, a queued request is "
        "refused once its wait and the engine's time to a first token now pass it, and the requests in flight are "
        "capped while the engine's first tokens take more than half of it (under auto too with "
        "--sustained-feedback on). off: only --queue-timeout and the clients' deadlines."
    )
    sustained_feedback: Literal["on", "off"] = Field(
        "off", description="on: under --ttft-objective auto, the derived objective (twice the wait) is held as "
        "--ttft-objective SECONDS is while the overload is sustained (a queued request refused once known late, the "
        "requests in flight capped on the engine's first tokens), the overload stays sustained while arrivals are "
        "refused, and first tokens meanwhile are not taken for the engine's unhurried time. off: as before."
    )
    max_concurrency: int | None = Field(
        None, ge=1, description="Most requests in flight upstream at once, whatever the KV budget."
    )
    starvation_bound: int = Field(
        8, ge=0, description="How many smaller requests may pass a blocked larger one at the head of the queue."
    )
    fair_queueing: Literal["on", "off"] = Field(
        "on", description="on: the queue serves tenants by weighted fair share of tokens served, priorities within "
        "a tenant; off: one queue by priority, FIFO within a priority."
    )
    tenant_headroom: Literal["on", "off"] = Field(
        "on", description="on (with fair queueing): while two or more tenants are active (sent a request in the last "
        "30 s), a request leaves free the KV blocks each other one recently held and asked for, up to its weighted "
        "fair share; off: a tenant may take every free block."
    )
    time_aware: Literal["on", "off"] = Field(
        "off", description="on: strict also admits when the peak of the engine's usage over the coming steps fits the "
        "budget, the streamed requests in flight ending in turn and the new one growing a token a step (not with "
        "speculative decoding); off: every request in flight counts at its full size at once."
    )
    scrape_interval: float = Field(
        0.25, gt=0, description="Seconds between scrapes of the engine's /metrics."
    )
    metrics_stale_after: float = Field(
        2.0, gt=0, description="Engine metrics older than this are stale and only the ledger is trusted."
    )
