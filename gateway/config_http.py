"""Settings of the HTTP edge: body, connection and header limits, timeouts towards the engine, request
templates, upstream streams (a part of ``Settings``)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, Field, field_validator

# A stream's answer bytes held for one client that reads slower than the engine writes: ~15K tokens of plain
# chat chunks (~250 bytes a token), so an ordinary answer never waits on its reader, or ~1-2K tokens with top-20
# logprobs; 1,000 stalled streams hold at most 4 GiB, and --write-timeout frees each within seconds.
MAX_BUFFERED_BYTES = 4 * 1024 * 1024
# Idle connections are kept longer than the common clients keep them in their pools, so that the client always
# closes first: a server that closes an idle connection as the client sends a request on it loses that request
# (a reset, or a silent close the client may not retry). Their defaults, read in their sources: httpx (so the
# OpenAI Python SDK, whose pool is httpx's) keepalive_expiry 5 s; aiohttp's TCPConnector keepalive_timeout 15 s;
# nginx upstream keepalive_timeout 60 s (its client side 75 s); Go's net/http DefaultTransport IdleConnTimeout
# 90 s. An idle connection holds a few KiB and counts towards --max-connections, which bounds them all.
KEEP_ALIVE_TIMEOUT = 120.0
# All slow readers together: a quarter of what 2,048 connections (--max-connections) could each hold.
MAX_TOTAL_BUFFERED_BYTES = 2 * 1024 * 1024 * 1024
# --authority auto: the admission authority serves no requests of its own from this many workers on. With M
# processes on M cores and the port spreading connections evenly, a serving authority's core is full at
# M / (w + (M - 1) c) requests a second (its share, and the coordination c of every other's), an authority apart
# (M workers, one process more) at min(M / (w + c), 1 / c) where the cores are M: equal at M = 2, higher from 3
# on for any c < w. Measured c / w apart: 0.13-0.15 per short chat and per relayed token (docs/overhead.md).
APART_FROM = 3


class HttpFields(BaseModel):
    # -- the data plane ---------------------------------------------------------------------------
    workers: str = Field(
        "1", description="Processes that accept and relay requests: a number, or 'auto' for the cores this process "
        "may run on. One of them, the admission authority, holds the admission and the tenants' limits for all; "
        "the others ask it per request (docs/architecture.md).",
    )

    @field_validator("starved_stretch")
    @classmethod
    def _starved_stretch(cls, value: float) -> float:
        # A stretch below 1 would end before the timeout it stretches: every such value acted as 0, silently.
        if 0 < value < 1:
            raise ValueError(f"--starved-stretch must be 0 (off) or from 1 to 100; got {value:g}")
        return value

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: object) -> str:
        value = str(value).strip().lower()
        if value != "auto" and not (value.isdigit() and 1 <= int(value) <= 256):
            raise ValueError(f"--workers must be a number from 1 to 256 or 'auto'; got {value!r}")
        return value

    def worker_count(self) -> int:
        """How many processes serve: ``--workers``, or the cores this process may run on."""
        if self.workers == "auto":
            return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        return int(self.workers)

    authority: Literal["auto", "serving", "apart"] = Field(
        "auto", description="With --workers 2 or more: whether the admission authority also accepts and relays "
        "requests (serving: it is one of the --workers processes) or only admits for them (apart: one process "
        "more, off the port). auto: apart from 3 workers on, where the coordination of the others' requests fills "
        "the authority's core before the workers' cores are full (docs/overhead.md).",
    )

    def authority_apart(self) -> bool:
        """Whether the admission authority serves no requests of its own (``--authority``); never with one process."""
        count = self.worker_count()
        if count <= 1:
            return False
        return self.authority == "apart" or (self.authority == "auto" and count >= APART_FROM)

    # -- HTTP limits and timeouts -----------------------------------------------------------------
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest request body accepted; larger gets 413."
    )
    connect_timeout: float = Field(5.0, gt=0, description="Seconds to connect to the upstream.")
    request_timeout: float = Field(
        600.0, gt=0, description="Seconds an upstream request may take in total (streams included)."
    )
    read_timeout: float = Field(
        300.0, gt=0, description="Seconds the upstream may stay silent (first byte or between chunks)."
    )
    upstream_connections: int = Field(
        512, ge=1, description="Most pooled connections to the upstream."
    )

    # -- connection limits ------------------------------------------------------------------------
    max_header_bytes: int = Field(
        32 * 1024, ge=1024, description="Largest request line plus headers, in bytes; larger gets 431."
    )
    max_headers: int = Field(100, ge=1, description="Most headers in one request; more gets 431.")
    header_timeout: float = Field(
        10.0, gt=0, description="Seconds a request line and its headers may take from their first byte; "
        "slower gets 408 and the connection is closed."
    )
    keep_alive_timeout: float = Field(
        KEEP_ALIVE_TIMEOUT, gt=0, description="Seconds a connection may stay idle after a response before it is "
        "closed (one just opened waits for its first request no longer than --header-timeout either): longer than "
        "the clients' own pools keep an idle connection (httpx and the OpenAI SDK 5 s, aiohttp 15 s, nginx 60 s, "
        "Go 90 s), so that the gateway never closes one a client is about to reuse. Idle connections count "
        "towards --max-connections.",
    )
    max_connections: int = Field(
        2048, ge=1, description="Most client connections open at once; one more gets 503 with Retry-After and "
        "is closed. With --workers each process holds an equal share (connections are its memory).",
    )
    body_timeout: float = Field(
        30.0, gt=0, description="Seconds a request body may take to arrive in total; slower gets 408."
    )
    min_body_rate: float = Field(
        1024.0, ge=0, description="Slowest request body accepted after --body-rate-grace, in bytes per second; "
        "slower gets 408 (0: no minimum)."
    )
    body_rate_grace: float = Field(
        5.0, ge=0, description="Seconds a request body may take before --min-body-rate applies."
    )

    max_answer_bytes: int = Field(
        16 * 1024 * 1024, ge=64 * 1024,
        description="Largest answer read whole from the upstream on a pass-through route (/tokenize, /detokenize, "
        "/version, --passthrough-route); a larger one is not read further and gets 502. vLLM's /tokenize answers "
        "~20 bytes a token with token_strs: the default covers prompts of ~800K tokens.",
    )

    max_buffered_bytes: int = Field(
        MAX_BUFFERED_BYTES, ge=64 * 1024,
        description="Most answer bytes held for one stream's client that reads slower than the engine writes "
        "(the engine's stream is read on regardless, so its KV blocks are given back when it ends); past this "
        "the stream is cut: the engine's request is cancelled and the client gets an error event "
        "(client_too_slow) and the stream's end.",
    )
    max_total_buffered_bytes: int = Field(
        MAX_TOTAL_BUFFERED_BYTES, ge=1024 * 1024,
        description="Most answer bytes held for slow readers, all streams of one gateway process together; past "
        "this the streams holding the most are cut first, as --max-buffered-bytes cuts one (client_too_slow), so "
        "memory stays bounded however many clients stop reading.",
    )
    write_timeout: float = Field(
        30.0, gt=0, description="Seconds a client may accept no byte of an answer while the gateway has bytes "
        "waiting for it; then its connection is closed. On a busy host the time the host starved work of a CPU "
        "(/proc/pressure/cpu) is not counted, up to --starved-stretch times this in all; so for --header-timeout "
        "and the body's.",
    )
    starved_stretch: float = Field(
        4.0, ge=0, le=100, description="The most a busy host stretches a client's connection timeouts "
        "(--header-timeout, the body's, --write-timeout), as a multiple of each: the time the host starved work of "
        "a CPU (/proc/pressure/cpu) is not counted against a client that may not have run; 0 or 1 to 100. 0: "
        "every timeout by the clock alone, on a busy host too (a hostile client is then cut on time, a starved one "
        "with it).",
    )

    # -- request templates ------------------------------------------------------------------------
    trust_request_chat_template: bool = Field(
        False,
        description="Accept a chat_template sent in a request (as vLLM's flag of the same name; the engine "
        "needs it too). Off: such requests get 400. On: the gateway renders them in a sandboxed worker "
        "process bounded by the --request-template-* limits.",
    )
    request_template_timeout: float = Field(
        1.0, gt=0, le=60, description="Seconds a request's chat_template may take to render; longer gets 400."
    )
    request_template_max_chars: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Most characters a request's chat_template may render; more gets 400.",
    )
    request_template_memory_mib: int = Field(
        512,
        ge=64,
        description="Memory (MiB of address space) a request template's render may add to its worker process; "
        "more gets 400.",
    )
    request_template_workers: int = Field(
        1,
        ge=1,
        le=32,
        description="Worker processes rendering request templates; further renders queue for one.",
    )

    # -- upstream streams -------------------------------------------------------------------------
    max_stream_event_bytes: int = Field(
        16 * 1024 * 1024,
        ge=64 * 1024,
        description="Largest single server-sent event accepted from the upstream (streams are relayed one whole "
        "event per write, so an event is held until its end); a larger one ends the stream with an error event.",
    )
