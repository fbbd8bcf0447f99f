"""Values a client controls, cut to a bound before they reach a log line or a span (``clip``).

A client decides how long a model name, a header or a path is, up to the body and header limits (megabytes):
written whole, one such value made an 8 MB log line per request and took the event loop seconds to escape.
Whatever shows such a value shows it clipped, in one documented form::

    <its first HEAD characters>...[cut: <its length> chars, <hash>]

where ``<hash>`` is 12 hex digits of BLAKE2b over the value's length and its first and last ``SAMPLE``
characters: enough to tell two cut values apart in a log, at a cost that does not grow with the value (a hash of
all of an 8 MiB value took 20-60 ms on the event loop, measured on the 2-core test machine). A clipped value is
never longer than the bound it was cut to (any bound of 64 characters or more: the marker takes up to 45).
"""

from __future__ import annotations

import hashlib

# The bound of one field of the access log or one span attribute: a model name (a Hugging Face id is at most 96
# characters; a local path a few hundred), a tenant, a reason.
FIELD_CHARS = 256
# Characters of a cut value's start and end that its hash covers.
SAMPLE = 1024


def clip(value: str, limit: int = FIELD_CHARS) -> str:
    """``value`` when it has at most ``limit`` characters, else its documented cut form (at most ``limit``)."""
    if len(value) <= limit:
        return value
    tail = cut_marker(value)
    return value[: max(0, limit - len(tail))] + tail


def cut_marker(value: str) -> str:
    """What follows the start of a cut value: ``...[cut: <length> chars, <hash>]``."""
    return f"...[cut: {len(value)} chars, {digest(value)}]"


def digest(value: str) -> str:
    """12 hex digits over the length and the first and last ``SAMPLE`` characters (see the module)."""
    sample = value if len(value) <= 2 * SAMPLE else value[:SAMPLE] + value[-SAMPLE:]
    h = hashlib.blake2b(str(len(value)).encode(), digest_size=6)
    h.update(sample.encode("utf-8", "surrogatepass"))
    return h.hexdigest()
