"""The probe a progress detector sends when an engine has been still for half its bound (``progress.py``): does
the engine answer at all?"""

from __future__ import annotations

import orjson

from gateway.engine.client import Upstream
from gateway.errors import GatewayError

# It asks for the least work a completion can be.
PROBE_BODY = {"prompt": "ping", "max_tokens": 1, "temperature": 0}


async def completion_probe(client: Upstream, model: str | None, timeout: float) -> bool:
    """One completion of one token sent straight to the engine; True when it answered 200 within ``timeout``."""
    if model is None:
        return False
    body = orjson.dumps({"model": model, **PROBE_BODY})
    try:
        reply = await client.request(
            "POST", "/v1/completions", body=body, headers={"content-type": "application/json"}, timeout=timeout
        )
    except GatewayError:
        return False
    return reply.status == 200


__all__ = ["PROBE_BODY", "completion_probe"]
