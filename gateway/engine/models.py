"""The models the upstream serves: its ``/v1/models``, held once for the whole gateway.

Read at start-up and whenever someone lists the models; read again when the engine view sees the engine come
back after a failed scrape, since a restarted engine (a crash, an auto-fit) may serve another context length.
"""

from __future__ import annotations

import asyncio
import contextlib

from gateway.engine.client import Upstream
from gateway.engine.live import EngineSnapshot
from gateway.engine.vllm_api import ModelList, parse_models, rewrite_max_model_len, upstream_error_from
from gateway.errors import GatewayError, ModelNotFound, UpstreamUnavailable

MODELS_PATH = "/v1/models"


class ServedModels:
    def __init__(self, upstream: Upstream, *, served_model_name: str | None = None) -> None:
        self._upstream = upstream
        # A name the gateway answers to besides the upstream's own (--served-model-name).
        self._served_model_name = served_model_name
        self._listing: ModelList | None = None
        self._lock = asyncio.Lock()
        # The loop keeps only weak references to tasks: a refresh started by the engine view is held here.
        self._refreshing: asyncio.Task[None] | None = None

    @property
    def cached(self) -> ModelList | None:
        return self._listing

    def update(self, listing: ModelList) -> None:
        self._listing = listing

    async def refresh(self) -> ModelList:
        reply = await self._upstream.request("GET", MODELS_PATH, timeout=10.0)
        if reply.status != 200:
            err = upstream_error_from(reply.status, reply.body)
            raise UpstreamUnavailable(
                f"The upstream's {MODELS_PATH} answered HTTP {reply.status}: {err.message}", retry_after=5
            )
        self._listing = parse_models(reply.body)
        return self._listing

    async def info(self) -> ModelList:
        """The listing, read from the upstream on first use."""
        if self._listing is None:
            async with self._lock:
                if self._listing is None:
                    await self.refresh()
        assert self._listing is not None
        return self._listing

    def check_model(self, requested: str | None, listing: ModelList) -> None:
        """404 for a model the upstream does not serve (as vLLM and OpenAI answer)."""
        if requested is None or not listing.ids or requested in listing.ids:
            return
        if self._served_model_name and requested == self._served_model_name:
            return
        raise ModelNotFound(
            f"The model `{requested}` does not exist. Served: {', '.join(listing.ids)}.", param="model"
        )

    def rewrite_listing(self, payload: bytes, effective_max_model_len: int | None) -> bytes:
        """/v1/models as the upstream says, with max_model_len lowered to the gateway's limit."""
        return rewrite_max_model_len(payload, effective_max_model_len)

    def follow(self, old: EngineSnapshot, new: EngineSnapshot) -> None:
        """An engine view listener: re-read the listing when the engine answers again after a failed scrape,
        or while no listing with a context length has been read."""
        if not new.ok:
            return
        if old.ok and self._listing is not None and self._listing.max_model_len is not None:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_quietly())

    async def close(self) -> None:
        """Cancel and await a re-read still running (owned here, so nothing outlives shutdown)."""
        task, self._refreshing = self._refreshing, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _refresh_quietly(self) -> None:
        with contextlib.suppress(GatewayError):
            await self.refresh()
