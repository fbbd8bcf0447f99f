"""The headers the gateway does not pass on, in one place: those of one hop, and the client's credentials.

RFC 9110 7.6.1 names the headers that describe one connection; a proxy answers for them itself. Each hop also
sets its own ``host`` and frames its own body (``content-length``), so those are not passed on either.
"""

from __future__ import annotations

# One connection's headers (RFC 9110 7.6.1), and the address and framing each hop sets for itself.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "transfer-encoding",
    "upgrade", "host", "content-length",
})
# The client's credentials: its key is the gateway's (the upstream gets --upstream-api-key instead), and its
# cookies are no business of the upstream's.
CREDENTIALS = frozenset({"authorization", "x-api-key", "cookie", "cookie2"})
# A request's headers never forwarded to the engine when the client's credentials are (a worker's to its
# authority): the hop's own, and accept-encoding, since the gateway asks for identity.
HOP_ONLY = HOP_BY_HOP | {"accept-encoding"}
# A request's headers never forwarded to the engine.
HOP_HEADERS = HOP_ONLY | CREDENTIALS
# An answer's headers not relayed from the engine: its connection's, its framing (the gateway frames the answer
# itself), and those the gateway's own server writes.
RESPONSE_DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"})
