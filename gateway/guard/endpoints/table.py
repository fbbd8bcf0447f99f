"""The one table of guarded endpoints: every route on which vLLM counts tokens against the context, served only
through the guard. A route's name and paths are written here and nowhere else; the HTTP layer routes by
``BY_PATH``, the pipeline parses by ``BY_NAME``."""

from __future__ import annotations

from typing import Any

from gateway.guard.endpoints.base import Endpoint, GuardedRequest
from gateway.guard.endpoints.chat import CHAT
from gateway.guard.endpoints.completions import COMPLETIONS
from gateway.guard.endpoints.pooling import CLASSIFY, EMBEDDINGS, POOLING, RERANK, SCORE, PoolingRequest
from gateway.guard.endpoints.responses import RESPONSES

Request = GuardedRequest | PoolingRequest
AnyEndpoint = Endpoint[GuardedRequest] | Endpoint[PoolingRequest]

ENDPOINTS: tuple[AnyEndpoint, ...] = (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS, POOLING, SCORE, RERANK, CLASSIFY)
BY_NAME: dict[str, AnyEndpoint] = {e.name: e for e in ENDPOINTS}
BY_PATH: dict[str, AnyEndpoint] = {path: e for e in ENDPOINTS for path in e.paths}


def parse(route: str, body: dict[str, Any]) -> Request:
    """The request of the endpoint named ``route``, validated (``InvalidRequest`` and the like otherwise)."""
    return BY_NAME[route].parse(body)
