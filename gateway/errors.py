"""The gateway's one error hierarchy, in domain terms only.

Stages raise ``GatewayError`` subclasses; each says what went wrong (``message``, ``param``, ``code``), whether it
is the client's doing (``client_fault``), the rejection reason it counts under, and when a retry may help. What
status and OpenAI type an error is answered with is the HTTP layer's business (``gateway.http.errors``): this
module imports nothing from a web framework, so the offline tools can raise these errors too.
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    code: str | None = None
    # The reason label for vllm_guard_rejections_total; None: not counted as a rejection.
    reason: str | None = None
    # The client's mistake (answered 4xx), as opposed to ours or the upstream's.
    client_fault: bool = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        close_connection: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        # Seconds after which a retry may succeed; None: retrying does not help (or nobody knows).
        self.retry_after = retry_after
        # The connection cannot be reused after this error (a half-read body).
        self.close_connection = close_connection


# -- client mistakes ------------------------------------------------------------------------------
class InvalidRequest(GatewayError):
    client_fault = True
    reason = "invalid_request"


class UnsupportedField(InvalidRequest):
    """A request field that would make the engine run a prompt other than the one the gateway counted, or hold
    blocks it did not book (``gateway.guard.fields`` says which and why); ``param`` names it."""

    code = "unsupported_field"
    reason = "unsupported_field"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"
    reason = "context_length"


class MaxTokensExceeded(InvalidRequest):
    """max_tokens does not fit what the context leaves (policy reject)."""

    code = "context_length_exceeded"
    reason = "max_tokens"

    def __init__(self, message: str, **kw: Any) -> None:
        kw.setdefault("param", "max_tokens")
        super().__init__(message, **kw)


class KVBudgetExceeded(InvalidRequest):
    """A single request that could never fit the engine's whole KV budget: a client mistake like an
    over-long prompt. Retrying cannot help, so no Retry-After."""

    code = "kv_budget_exceeded"
    reason = "kv_budget"


class ModelNotFound(InvalidRequest):
    code = "model_not_found"
    reason = "model_not_found"


class NotFound(InvalidRequest):
    code = "not_found"
    reason = "not_found"


class MethodNotAllowed(InvalidRequest):
    code = "method_not_allowed"

    def __init__(self, message: str, *, allowed: str | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.allowed = allowed  # the method the path takes


class PayloadTooLarge(InvalidRequest):
    code = "request_too_large"
    reason = "body_too_large"


class AuthenticationFailed(GatewayError):
    client_fault = True
    code = "invalid_api_key"
    reason = "auth"


class PermissionDenied(GatewayError):
    client_fault = True
    code = "admin_key_required"
    reason = "auth"


class QueueFull(GatewayError):
    """Too many requests waiting: the client should slow down (a rate limit, not our failure)."""

    client_fault = True
    code = "queue_full"
    reason = "queue_full"


class TenantRateLimited(GatewayError):
    """A tenant over one of its limits (requests or tokens per minute, concurrent requests): 429 with the
    ``Retry-After`` of the window. ``limit`` names the limit; ``reason`` counts the refusal under it."""

    client_fault = True
    code = "rate_limit_exceeded"
    reason = "tenant_rate_limit"

    def __init__(self, message: str, *, limit: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.limit = limit
        self.reason = f"tenant_{limit}"


# -- configuration --------------------------------------------------------------------------------
class ConfigInvalid(GatewayError, ValueError):
    """A configuration file that cannot be used (the keys file): named with the line or field at fault, never
    with a key's value. A ``ValueError`` too, so the command line reports it like a bad flag."""

    code = "config_invalid"


# -- our side or the upstream's -------------------------------------------------------------------
class QueueTimeout(GatewayError):
    code = "queue_timeout"
    reason = "queue_timeout"


class QueueTimeoutExpected(QueueTimeout):
    """Queued, and forecast to wait past its queue timeout: refused at once rather than at the deadline. A 503
    like the timeout it stands for (the gateway lacks capacity; the queue had room, so no rate limit was hit)."""

    code = "queue_timeout_expected"
    reason = "queue_timeout_expected"


class DeadlineUnreachable(QueueTimeoutExpected):
    """Forecast to get no first token before its own deadline (the client's timeout, ``x-guard-deadline-ms``,
    ``--ttft-objective``): refused at once, never after waiting it out; or it reached that deadline queued."""

    code = "deadline"
    reason = "deadline"


class UpstreamUnavailable(GatewayError):
    """The upstream cannot be reached, or is starting, restarting, draining or down."""

    code = "upstream_unavailable"
    reason = "upstream_unavailable"


class UpstreamLost(UpstreamUnavailable):
    """The upstream closed a connection under a request before the end of its answer.

    ``may_have_read``: the request's last byte had gone out to the upstream, which may then have read it whole
    and run it; false only when part of it still waited in the connection's buffer. ``resent``: the request went
    out a second time already (``Upstream.open`` sets it), so nothing (the pipeline's failover included) sends
    it again: a request goes out at most twice, and twice only when the first cannot have been read."""

    def __init__(self, message: str, *, may_have_read: bool, retry_after: float = 5.0) -> None:
        super().__init__(message, retry_after=retry_after)
        self.may_have_read = may_have_read
        self.resent = False


class UpstreamHung(UpstreamUnavailable):
    """The engine makes no progress while work runs (its engine core frozen or stuck): nothing sent to it
    would be answered, so requests are refused at once and those in flight are cut."""

    code = "upstream_hung"
    reason = "upstream_hung"


class UpstreamTimeout(GatewayError):
    code = "upstream_timeout"
    reason = "upstream_timeout"


class BadUpstreamResponse(GatewayError):
    code = "bad_upstream_response"
    reason = "bad_upstream_response"


class UpstreamError(GatewayError):
    """An error answer from the upstream, relayed as it came: its status, its (OpenAI) type, and its own
    ``Retry-After`` when it sent one."""

    reason = "upstream_error"

    def __init__(
        self, status: int, message: str, *, type: str, param: str | None, code: str | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.status = status
        self.type = type
        self.client_fault = status < 500
        self.upstream_retry_after = (headers or {}).get("retry-after")


class EngineQueueFull(UpstreamError):
    """vLLM's own waiting-queue cap (``--max-num-queued-reqs`` / ``--max-num-queued-tokens``, 0.29+) refused the
    request: a 503 of the gateway's own with a ``Retry-After`` (vLLM sends none) and its own rejection reason.
    An ``UpstreamError`` still, so a request it refused before any byte went out fails over to another engine."""

    code = "engine_queue_full"
    reason = "engine_queue_full"

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(503, message, type="server_error", param=None, code="engine_queue_full")
        self.retry_after = retry_after


# -- connection and protocol limits (the HTTP server answers these itself) ------------------------
class RequestTimeout(InvalidRequest):
    """The request line, headers or body did not arrive in time."""

    code = "request_timeout"
    reason = "request_timeout"


class HeadersTooLarge(InvalidRequest):
    code = "headers_too_large"
    reason = "headers_too_large"


class TooManyConnections(GatewayError):
    code = "too_many_connections"
    reason = "too_many_connections"


class ClientTooSlow(InvalidRequest):
    """A stream's client let more of its answer wait than ``--max-buffered-bytes``: the stream is cut (told as
    an error event after the events the client has)."""

    code = "client_too_slow"
    reason = "client_too_slow"
