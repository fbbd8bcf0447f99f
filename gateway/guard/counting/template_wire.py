"""What the gateway and its template worker share: the frame header of their pipe, and the wording of template
errors (the model's own template renders in the gateway, a request's in the worker; both word failures alike).

Kept apart from ``template_worker`` so the gateway never imports the module the worker runs as ``__main__``.
"""

from __future__ import annotations

import struct

# Each frame: this 4-byte big-endian length, then that many bytes.
FRAME = struct.Struct(">I")


# A template's error may quote the request (a 7 MB role: "Unknown message role: uuu..."): the answer and the log
# carry this much of it.
MAX_REASON_CHARS = 1000


def template_error_reason(exc: BaseException) -> str:
    """The most specific message in a template error's chain, as vLLM reports it, cut to ``MAX_REASON_CHARS``."""
    reason = _reason(exc)
    if len(reason) <= MAX_REASON_CHARS:
        return reason
    return f"{reason[:MAX_REASON_CHARS]}... ({len(reason) - MAX_REASON_CHARS} more characters)"


def _reason(exc: BaseException) -> str:
    import jinja2

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)
