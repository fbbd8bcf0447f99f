"""What the gateway knows of the served model: ids, root, max_model_len, and the counter for it.

Fetched from the upstream's /v1/models at start-up and refreshed whenever the engine view sees a change;
the tokenizer is loaded once, off the event loop, from --tokenizer or else the model's root, falling back
to the upstream's /tokenize (announced once in the log and in a metric).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.config import Settings
from gateway.engine.client import Upstream
from gateway.errors import BadUpstreamResponse, ModelNotFound, UpstreamUnavailable, upstream_error_from
from gateway.guard.counting.templates import RequestTemplates
from gateway.guard.counting.tokens import Counter, LocalCounter, RemoteCounter, TokenizerUnavailable, load_tokenizer
from gateway.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    ids: tuple[str, ...]
    root: str | None
    max_model_len: int | None
    fetched_at: float = field(default_factory=time.monotonic)


def parse_models(payload: bytes) -> ModelInfo:
    try:
        data = orjson.loads(payload)
        entries = data["data"]
        if not isinstance(entries, list):
            raise TypeError("data is not a list")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise BadUpstreamResponse(f"The upstream's /v1/models answer is not a model list ({exc}).") from exc
    ids = tuple(str(e.get("id")) for e in entries if isinstance(e, dict) and e.get("id"))
    first = entries[0] if entries and isinstance(entries[0], dict) else {}
    mml = first.get("max_model_len")
    root = first.get("root")
    return ModelInfo(ids, root if isinstance(root, str) else None, mml if isinstance(mml, int) else None)


class Models:
    def __init__(
        self, settings: Settings, upstream: Upstream, metrics: Metrics, executor: Executor | None = None
    ) -> None:
        self._settings = settings
        self._upstream = upstream
        self._metrics = metrics
        self._executor = executor
        # Request-supplied chat templates: refused, or rendered in worker processes closed with the app.
        self.templates = RequestTemplates.from_settings(settings)
        self._info: ModelInfo | None = None
        self._counter: Counter | None = None
        self._lock = asyncio.Lock()

    @property
    def cached(self) -> ModelInfo | None:
        return self._info

    def update(self, info: ModelInfo) -> None:
        self._info = info

    async def refresh(self) -> ModelInfo:
        reply = await self._upstream.request("GET", "/v1/models", timeout=10.0)
        if reply.status != 200:
            err = upstream_error_from(reply.status, reply.body)
            raise UpstreamUnavailable(
                f"The upstream's /v1/models answered HTTP {reply.status}: {err.message}", retry_after=5
            )
        self._info = parse_models(reply.body)
        return self._info

    async def info(self) -> ModelInfo:
        if self._info is None:
            async with self._lock:
                if self._info is None:
                    await self.refresh()
        assert self._info is not None
        return self._info

    def check_model(self, requested: str | None, info: ModelInfo) -> None:
        """404 for a model the upstream does not serve (as vLLM and OpenAI answer)."""
        if requested is None or not info.ids or requested in info.ids:
            return
        if self._settings.served_model_name and requested == self._settings.served_model_name:
            return
        raise ModelNotFound(
            f"The model `{requested}` does not exist. Served: {', '.join(info.ids)}.", param="model"
        )

    async def counter(self) -> Counter:
        if self._counter is None:
            async with self._lock:
                if self._counter is None:
                    self._counter = await self._load_counter()
        return self._counter

    async def _load_counter(self) -> Counter:
        source = self._settings.tokenizer or self._settings.model
        if source is None:
            info = self._info or await self.refresh()
            source = info.root or (info.ids[0] if info.ids else None)
        if source is not None:
            try:
                loop = asyncio.get_running_loop()
                tokenizer = await loop.run_in_executor(self._executor, load_tokenizer, source)
                log.info("counting tokens with the tokenizer of %s", source)
                self._metrics.record_tokenizer_fallback(False)
                # Media parts cannot be counted locally; the engine's /tokenize counts those requests.
                return LocalCounter(tokenizer, self._executor, fallback=self._remote(), templates=self.templates)
            except TokenizerUnavailable as exc:
                reason = str(exc)
        else:
            reason = "the upstream names no model root"
        log.warning(
            "no local tokenizer (%s): counting with the upstream's /tokenize, one extra round trip per "
            "request; pass --tokenizer PATH to count locally",
            reason,
        )
        self._metrics.record_tokenizer_fallback(True)
        if self._info is None:
            await self.refresh()
        return self._remote()

    def _remote(self) -> RemoteCounter:
        ids = self._info.ids if self._info is not None else ()
        model = self._settings.served_model_name or (ids[0] if ids else "")
        return RemoteCounter(self._upstream.tokenize, model, templates=self.templates)

    def rewrite_listing(self, payload: bytes, effective_max_model_len: int | None) -> bytes:
        """/v1/models as the upstream says, with max_model_len lowered to the gateway's limit."""
        data: Any = orjson.loads(payload)
        if effective_max_model_len is not None and isinstance(data, dict):
            for entry in data.get("data") or []:
                if isinstance(entry, dict):
                    entry["max_model_len"] = effective_max_model_len
        return orjson.dumps(data)
