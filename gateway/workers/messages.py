"""What crosses between a worker and the admission authority, written as JSON: errors and reservations.

An error refused by the authority (a full queue, a tenant's limit, a deadline) reaches the worker as the same
``GatewayError`` subclass with the same fields, so that the HTTP layer answers it exactly as it would have in one
process. Only the gateway's own error classes are rebuilt; anything else becomes an ``UpstreamUnavailable``
(never a 500 for a refusal that crossed a socket).
"""

from __future__ import annotations

from typing import Any

from gateway import errors
from gateway.admission.prefix import PromptPrefix
from gateway.errors import GatewayError

_CLASSES: dict[str, type[GatewayError]] = {
    name: cls for name, cls in vars(errors).items()
    if isinstance(cls, type) and issubclass(cls, GatewayError)
}
_PLAIN = (str, int, float, bool, type(None))


def error_to_json(exc: GatewayError) -> dict[str, Any]:
    """The error's class and every plain attribute it carries (message, code, param, retry_after, ...)."""
    fields = {k: v for k, v in vars(exc).items() if isinstance(v, _PLAIN)}
    return {"class": type(exc).__name__, "fields": fields}


def error_from_json(data: dict[str, Any]) -> GatewayError:
    cls = _CLASSES.get(str(data.get("class")))
    raw = data.get("fields")
    fields: dict[str, Any] = raw if isinstance(raw, dict) else {}
    message = str(fields.get("message", "The gateway's admission failed."))
    if cls is None:
        return errors.UpstreamUnavailable(message, retry_after=1)
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.message, exc.param, exc.retry_after, exc.close_connection = message, None, None, False
    for key, value in fields.items():
        setattr(exc, key, value)
    return exc


_ID_RANGE = range(-(2**63), 2**63)  # what JSON carries exactly, and vLLM's ids fit in


def prefix_to_json(prefix: PromptPrefix | None) -> dict[str, Any] | None:
    """The prompt's ids and salt; none for ids no engine accepts (its blocks are never shared: ``block_keys``)."""
    if prefix is None or not all(isinstance(i, int) and i in _ID_RANGE for i in prefix.ids):
        return None
    return {"ids": list(prefix.ids), "salt": prefix.salt}


def prefix_from_json(data: dict[str, Any] | None) -> PromptPrefix | None:
    if data is None:
        return None
    return PromptPrefix(tuple(data.get("ids", ())), str(data.get("salt", "")))
