"""The one shared HTTP client to the upstream vLLM.

aiohttp, chosen by measurement (docs/http-client.md): httpx's own pool gave ~400 req/s at concurrency 64
on this hardware, aiohttp ~4,000. Transport failures become ``GatewayError``s here and nowhere else.
"""

from __future__ import annotations

import logging
import warnings
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from yarl import URL

from gateway.config import Settings
from gateway.engine.vllm_api import upstream_error_from
from gateway.errors import BadUpstreamResponse, GatewayError, UpstreamTimeout, UpstreamUnavailable
from gateway.redact import redact_url, redact_urls_in

log = logging.getLogger(__name__)

# Headers that describe one hop, never forwarded (RFC 9110 7.6.1), plus those we set ourselves, plus the
# client's credentials: its key is the gateway's (the upstream gets --upstream-api-key instead), and its
# cookies are no business of the upstream's.
HOP_HEADERS = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
        "transfer-encoding", "upgrade", "host", "content-length", "authorization", "accept-encoding",
        "x-api-key", "cookie", "cookie2",
    }
)
RESPONSE_DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"})
# A retry hint for clients when the upstream cannot be reached at all.
UNREACHABLE_RETRY_AFTER = 5.0
KEEPALIVE_SECONDS = 4.0  # idle pooled connections to the engine are closed after this (see start())
# The gateway asks for identity; an upstream that compresses anyway is decoded up to this size per body.
DECODED_BODY_LIMIT = 256 * 1024 * 1024


@dataclass(slots=True)
class UpstreamReply:
    status: int
    headers: Mapping[str, str]
    body: bytes


class UpstreamStream:
    """An open upstream response whose body is relayed as it arrives. ``close`` is synchronous so that it
    can run inside a cancelled task (a client that went away); closing before the end aborts the upstream
    request."""

    def __init__(self, response: aiohttp.ClientResponse, timeout_error: Callable[[], GatewayError]) -> None:
        self._response = response
        self._timeout_error = timeout_error
        self.status = response.status
        self.headers = response.headers

    async def read_all(self) -> bytes:
        """The whole body, decoded if the upstream compressed it (though asked for identity)."""
        decoder = decoder_for(self.headers)
        raw = await self.read_raw()
        if decoder is None:
            return raw
        return decoder.decode(raw, DECODED_BODY_LIMIT) + decoder.finish()

    async def read_raw(self) -> bytes:
        """The whole body as sent (still compressed if it was), for relaying with its own headers."""
        try:
            return await self._response.read()
        except TimeoutError as exc:
            raise self._timeout_error() from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(
                f"The upstream dropped the connection: {redact_urls_in(str(exc))}",
                retry_after=UNREACHABLE_RETRY_AFTER,
            ) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, as sent (still compressed if it was: see ``decoder_for``)."""
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except TimeoutError as exc:
            raise self._timeout_error() from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(
                f"The upstream dropped the stream: {redact_urls_in(str(exc))}",
                retry_after=UNREACHABLE_RETRY_AFTER,
            ) from exc

    def close(self) -> None:
        # release() keeps a fully read connection for reuse, and closes one with unread body (a client
        # that left mid-stream), which is what makes vLLM abort that request.
        self._response.release()


class Upstream:
    def __init__(self, settings: Settings, base_url: Callable[[], str] | None = None) -> None:
        self._settings = settings
        self._base_url = base_url or (lambda: settings.upstream[0])
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[str, str], URL] = {}
        self._auth = {"Authorization": f"Bearer {settings.upstream_api_key}"} if settings.upstream_api_key else {}

    @property
    def base_url(self) -> str:
        return self._base_url()

    async def start(self) -> None:
        s = self._settings
        connector = aiohttp.TCPConnector(
            limit=s.upstream_connections, limit_per_host=s.upstream_connections, ttl_dns_cache=300,
            # Below vLLM's own idle timeout (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s in vllm/envs.py): a pooled connection
            # kept longer is one vLLM may close just as a request goes out on it, which the client would get as a
            # 503 "Server disconnected" (seen after a 5 s lull between two floods).
            enable_cleanup_closed=False, keepalive_timeout=KEEPALIVE_SECONDS,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=s.request_timeout, sock_connect=s.connect_timeout, sock_read=s.read_timeout
            ),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),  # an upstream's cookies must never leak between clients
            skip_auto_headers=("User-Agent",),
            json_serialize=lambda o: orjson.dumps(o).decode(),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() was not awaited")
        return self._session

    def _url(self, path: str) -> URL:
        # Parsed once per path: URL parsing was a measurable share of each proxied request.
        key = (self.base_url, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 1024:  # passthrough paths are client-chosen: keep the cache bounded
                self._urls.clear()
            url = self._urls[key] = URL(self.base_url + path)
        return url

    def _headers(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        headers = {k: v for k, v in (extra or {}).items() if k.lower() not in HOP_HEADERS}
        headers.update(self._auth)
        # aiohttp would offer gzip and deflate, and with auto_decompress off (it costs CPU on every read) a
        # compressed answer would reach clients labelled as plain. vLLM compresses nothing it is not asked to.
        headers["Accept-Encoding"] = "identity"
        return headers

    async def open(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> UpstreamStream:
        """Send a request and return once the response headers arrived; the caller closes it."""
        url = self._url(path)
        # Redirects are not followed: the gateway talks to one engine, by the paths of its route table.
        kwargs: dict[str, Any] = {"data": _payload(body), "headers": self._headers(headers), "allow_redirects": False}
        if params:
            kwargs["params"] = params
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout)
        try:
            response = await self._send(method, url, kwargs)
        except TimeoutError as exc:
            raise self._timeout(timeout) from exc
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnavailable(
                f"The upstream at {redact_url(self.base_url)} cannot be reached "
                f"({redact_urls_in(str(exc.os_error or exc))}).",
                retry_after=UNREACHABLE_RETRY_AFTER,
            ) from exc
        except aiohttp.ClientResponseError as exc:
            raise BadUpstreamResponse(f"The upstream sent an invalid HTTP response: {exc.message}") from exc
        except aiohttp.ClientError as exc:
            # Reset or closed before any response: the request may not have run; retrying is safe to suggest.
            raise UpstreamUnavailable(
                f"The upstream closed the connection before answering: {redact_urls_in(str(exc))}",
                retry_after=UNREACHABLE_RETRY_AFTER,
            ) from exc
        return UpstreamStream(response, lambda: self._timeout(timeout))

    async def _send(self, method: str, url: URL, kwargs: dict[str, Any]) -> aiohttp.ClientResponse:
        """The request, sent once more on a new connection when its connection breaks before any answer. Most
        often a pooled one the engine closed as the request went out (its idle timeout and ours race under load):
        it never saw the request whole, so it ran nothing. A new connection that breaks too is the second try."""
        try:
            return await self.session.request(method, url, **kwargs)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise  # not reached at all: no pooled connection to blame
            log.info("the upstream closed a pooled connection as a request went out (%s); sending it again", exc)
            return await self.session.request(method, url, **kwargs)

    def _timeout(self, timeout: float | None) -> UpstreamTimeout:
        s = self._settings
        limit = timeout if timeout is not None else s.request_timeout
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


def _payload(body: bytes | None) -> bytes | aiohttp.payload.BytesPayload | None:
    """``body`` as aiohttp sends it. Past 1 MiB aiohttp warns that bytes "might lock the event loop"; they are
    copied once into the socket's buffer (~1 ms for the largest body the gateway accepts), nothing more, and
    the payload is sent again as it is when a pooled connection broke (``_send``)."""
    if body is None or len(body) <= aiohttp.payload.TOO_LARGE_BYTES_BODY:
        return body
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        return aiohttp.payload.BytesPayload(body, content_type="application/json")
