"""The one shared HTTP client to each upstream vLLM.

Built on ``engine/wire.py``, ``connection.py`` and ``pool.py`` (asyncio protocols and the httptools parser),
chosen by measurement: aiohttp cost ~230 us of the gateway's CPU per short request more (docs/overhead.md), httpx's
own pool more still (docs/http-client.md). Transport failures become ``GatewayError``s here and in those modules,
nowhere else. A request is sent a second time only when the upstream cannot have read the first (``open``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import ssl
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlencode, urlsplit

import orjson

from gateway.config import Settings
from gateway.engine.pool import Pool
from gateway.engine.vllm_api import upstream_error_from
from gateway.engine.wire import UNREACHABLE_RETRY_AFTER, BufferSink, Exchange, Sink
from gateway.errors import BadUpstreamResponse, UpstreamLost, UpstreamTimeout, UpstreamUnavailable
from gateway.headers import HOP_HEADERS, HOP_ONLY, RESPONSE_DROP
from gateway.redact import redact_url, redact_urls_in

log = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 4.0  # idle pooled connections to the engine are closed after this (see start())
# The gateway asks for identity; an upstream that compresses anyway is decoded up to this size per body.
DECODED_BODY_LIMIT = 256 * 1024 * 1024


@dataclass(slots=True)
class UpstreamReply:
    status: int
    headers: Mapping[str, str]
    body: bytes


class UpstreamStream:
    """An open upstream answer whose body is relayed as it arrives. ``close`` is synchronous so that it can run
    inside a cancelled task (a client that went away); closing before the end aborts the upstream request."""

    __slots__ = ("_exchange", "headers", "status")

    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange
        self.status = exchange.status
        self.headers = exchange.headers

    async def read_all(self) -> bytes:
        """The whole body, decoded if the upstream compressed it (though asked for identity)."""
        decoder = decoder_for(self.headers)
        raw = await self.read_raw()
        if decoder is None:
            return raw
        return decoder.decode(raw, DECODED_BODY_LIMIT) + decoder.finish()

    async def read_raw(self) -> bytes:
        """The whole body as sent (still compressed if it was), for relaying with its own headers."""
        return b"".join([chunk async for chunk in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, as sent (still compressed if it was: see ``decoder_for``)."""
        sink = self._exchange.sink
        if not isinstance(sink, BufferSink):
            raise RuntimeError("the stream's body already goes to a sink of its own")
        while (chunk := await sink.next()) is not None:
            yield chunk

    def attach(self, sink: Sink) -> None:
        """Hand the body to ``sink`` as it arrives, from the loop's own callbacks: no task, no await per read
        (the guarded streams' relay)."""
        self._exchange.attach(sink)

    def close(self) -> None:
        # A whole answer's connection is pooled already; one with unread body is dropped, which is what makes
        # vLLM abort that request.
        self._exchange.close()


class Upstream:
    def __init__(
        self, settings: Settings, base_url: Callable[[], str] | None = None, *, credentials: bool = False
    ) -> None:
        """``credentials``: forward the client's own credentials (to the gateway's own authority, which checks
        them), where to an engine they never go."""
        self._settings = settings
        self._drop = HOP_ONLY if credentials else HOP_HEADERS
        self._base_url = base_url or (lambda: settings.upstream[0])
        self._pools: dict[str, Pool] = {}  # by base URL: a managed engine may move (restart on another port)
        self._sweeper: asyncio.Task[None] | None = None
        self._started = False
        self._auth = {"authorization": f"Bearer {settings.upstream_api_key}"} if settings.upstream_api_key else {}

    @property
    def base_url(self) -> str:
        return self._base_url()

    async def start(self) -> None:
        self._started = True
        s = self._settings
        # Timeouts are noticed by a sweep rather than a timer per read: a few times a second, finer for the
        # short limits tests set.
        every = max(0.02, min(0.25, s.read_timeout / 4, s.request_timeout / 4))
        self._sweeper = asyncio.create_task(self._sweep(every), name="upstream-sweeper")

    async def close(self) -> None:
        self._started = False
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    async def _sweep(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            for pool in self._pools.values():
                pool.sweep(self._timeout_of)

    def _pool(self) -> tuple[Pool, Target]:
        if not self._started:
            raise RuntimeError("Upstream.start() was not awaited")
        base = self.base_url
        target = _target(base)
        pool = self._pools.get(base)
        if pool is None:
            if len(self._pools) > 8:  # a managed engine's old addresses: their pools are done with
                for old in self._pools.values():
                    old.close()
                self._pools.clear()
            s = self._settings
            pool = self._pools[base] = Pool(
                target.host, target.port, target.tls, s.upstream_connections, KEEPALIVE_SECONDS,
                lambda: redact_url(base),
            )
        return pool, target

    def _head(self, target: Target, method: str, path: str, params: Mapping[str, str] | None,
              extra: Mapping[str, str] | None, body: bytes | None) -> bytes:
        path = target.prefix + path
        if params:
            path += "?" + urlencode(params)
        lines = [f"{method} {path} HTTP/1.1", f"host: {target.netloc}"]
        for name, value in (extra or {}).items():
            lower = name.lower()
            # Never forwarded: hop-by-hop headers, our own, credentials; nor a name or value that could split
            # the head (the client's headers were parsed, but a value set in code is checked here all the same).
            if lower in self._drop or not _TOKEN.issuperset(lower) or "\r" in value or "\n" in value:
                continue
            lines.append(f"{name}: {value}")
        lines.extend(f"{k}: {v}" for k, v in (self._auth or target.auth).items())
        # Compressed answers would reach clients labelled as plain: vLLM compresses nothing it is not asked to.
        lines.append("accept-encoding: identity")
        lines.append(f"content-length: {len(body) if body is not None else 0}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")
        return head + body if body else head

    async def open(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        timeout: float | None = None,
        connect_within: float | None = None,
        resend: bool = True,
    ) -> UpstreamStream:
        """Send a request and return once the response headers arrived; the caller closes it. A connection (a
        free place in the pool, or a new one) may take ``--connect-timeout``, or ``connect_within`` seconds when
        longer (a guarded request waits for an engine whose API server accepts late, a starved host's, within
        the request's own time).

        Sent once more, on a new connection, only when the upstream cannot have read it: a pooled connection
        lost before the request's last byte went out (or a GET, which changes nothing, lost before its answer
        began: the engine's idle timeout and ours race). Never on a new connection, and never when ``resend``
        is false (the pipeline's failover is the one resend then). The ``UpstreamLost`` of a resent request says
        so (``resent``)."""
        pool, target = self._pool()
        request = self._head(target, method, path, params, headers, body)
        s = self._settings
        total = timeout if timeout is not None else s.request_timeout
        deadline = pool.loop.time() + total
        within = min(max(s.connect_timeout, connect_within or 0.0), total)
        for attempt in (1, 2):
            exchange = Exchange(deadline, s.read_timeout)
            exchange.limit = total
            try:
                conn, pooled = await pool.connection(attempt == 1, within)
            except TimeoutError as exc:
                raise self._timeout(total) from exc
            except OSError as exc:
                raise self._unreachable(exc) from exc
            conn.send(exchange, request)
            try:
                await exchange.head
            except UpstreamLost as exc:
                if attempt == 1 and resend and pooled and (not exc.may_have_read or method == "GET"):
                    log.info("the upstream closed a pooled connection as a request went out; sending it again")
                    continue
                exc.resent = attempt == 2
                raise
            except asyncio.CancelledError:
                exchange.close()
                raise
            return UpstreamStream(exchange)
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _unreachable(self, exc: OSError) -> UpstreamUnavailable:
        return UpstreamUnavailable(
            f"The upstream at {redact_url(self.base_url)} cannot be reached ({redact_urls_in(str(exc))}).",
            retry_after=UNREACHABLE_RETRY_AFTER,
        )

    def _timeout_of(self, exchange: Exchange) -> UpstreamTimeout:
        return self._timeout(exchange.limit)

    def _timeout(self, limit: float) -> UpstreamTimeout:
        s = self._settings
        return UpstreamTimeout(
            f"The upstream did not answer in time (limits: {limit:g} s in total, "
            f"{s.read_timeout:g} s of silence, {s.connect_timeout:g} s to connect)."
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> UpstreamReply:
        stream = await self.open(method, path, body=body, headers=headers, params=params, timeout=timeout)
        try:
            data = await stream.read_all()
        finally:
            stream.close()
        return UpstreamReply(stream.status, stream.headers, data)

    async def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """Small GETs for the engine view (/metrics, /v1/models, /health)."""
        reply = await self.request("GET", path, timeout=timeout)
        return reply.status, reply.body

    async def tokenize(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The upstream's /tokenize, for counting when no local tokenizer can be loaded."""
        reply = await self.request(
            "POST", "/tokenize", body=orjson.dumps(payload), headers={"content-type": "application/json"},
            timeout=30.0,
        )
        if reply.status != 200:
            raise upstream_error_from(reply.status, reply.body, reply.headers)
        try:
            data = orjson.loads(reply.body)
        except orjson.JSONDecodeError as exc:
            raise BadUpstreamResponse("The upstream's /tokenize answered with invalid JSON.") from exc
        if not isinstance(data, dict):
            raise BadUpstreamResponse("The upstream's /tokenize answered with a non-object.")
        return data


@dataclass(frozen=True, slots=True)
class Target:
    """Where a base URL points: host, port, TLS, the path prefix, the Host header, credentials in the URL."""

    host: str
    port: int
    tls: ssl.SSLContext | None
    prefix: str
    netloc: str
    auth: dict[str, str]


_TARGETS: dict[str, Target] = {}
_TOKEN = frozenset("abcdefghijklmnopqrstuvwxyz0123456789!#$%&'*+-.^_`|~")


def _target(base: str) -> Target:
    """``base`` parsed once (a handful of engines per process)."""
    target = _TARGETS.get(base)
    if target is None and base.startswith("unix:"):
        target = _TARGETS[base] = Target(base[len("unix:"):], 0, None, "", "localhost", {})
    if target is None:
        url = urlsplit(base)
        tls = ssl.create_default_context() if url.scheme == "https" else None
        host = url.hostname or "127.0.0.1"
        port = url.port or (443 if tls is not None else 80)
        auth: dict[str, str] = {}
        if url.username is not None:
            pair = f"{unquote(url.username)}:{unquote(url.password or '')}"
            auth["authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        netloc = f"[{host}]" if ":" in host else host
        default = 443 if tls is not None else 80
        netloc = netloc if port == default else f"{netloc}:{port}"
        target = _TARGETS[base] = Target(host, port, tls, quote(url.path.rstrip("/")), netloc, auth)
    return target


class BodyDecoder:
    """Undoes a gzip or deflate Content-Encoding piece by piece, bounded: a small compressed read that would
    expand past ``limit`` bytes is refused rather than decoded (a compression bomb)."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        # 32 + 15: a gzip or zlib header, whichever it is (deflate is zlib-wrapped per RFC 9110).
        self._z = zlib.decompressobj(47)

    def decode(self, data: bytes, limit: int) -> bytes:
        try:
            out = self._z.decompress(data, limit)
        except zlib.error as exc:
            raise BadUpstreamResponse(f"The upstream's {self.encoding} body does not decode: {exc}.") from exc
        if self._z.unconsumed_tail:
            raise BadUpstreamResponse(f"The upstream's {self.encoding} body expands past {limit} bytes; refused.")
        return out

    def finish(self) -> bytes:
        """At the body's end: what is left; a compressed stream cut short raises."""
        if not self._z.eof:
            raise BadUpstreamResponse(f"The upstream's {self.encoding} body ended before its compressed end.")
        return self._z.flush()


def decoder_for(headers: Mapping[str, str]) -> BodyDecoder | None:
    """A decoder for the upstream's Content-Encoding; None for identity; ``BadUpstreamResponse`` for an
    encoding the gateway cannot decode (never relayed under a plain label)."""
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip", "deflate"):
        return BodyDecoder(encoding)
    raise BadUpstreamResponse(
        f"The upstream answered with Content-Encoding {encoding!r}, which the gateway cannot decode "
        "(it asks for identity)."
    )


def response_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Upstream response headers worth relaying to the client."""
    return {k: v for k, v in headers.items() if k.lower() not in RESPONSE_DROP}
