"""The token counter for the served model: its tokenizer, or else the upstream's ``/tokenize``.

The tokenizer is loaded once, off the event loop, from --tokenizer or else the model's root, falling back
to the upstream's /tokenize (announced once in the log and in a metric). The served models themselves live in
``gateway.engine.models``; ``Models`` is that registry plus the counter for its model.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor

from gateway.config import Settings
from gateway.engine.client import Upstream
from gateway.engine.models import ServedModels
from gateway.guard.counting import Counter, LocalCounter, RemoteCounter, TokenizerUnavailable, load_tokenizer
from gateway.guard.counting.templates import RequestTemplates
from gateway.guard.policy import effective_max_model_len
from gateway.metrics import Metrics

log = logging.getLogger(__name__)


class Models(ServedModels):
    def __init__(
        self, settings: Settings, upstream: Upstream, metrics: Metrics, executor: Executor | None = None
    ) -> None:
        super().__init__(upstream, served_model_name=settings.served_model_name)
        self._settings = settings
        self._metrics = metrics
        self._executor = executor
        # Request-supplied chat templates: refused, or rendered in worker processes closed with the app.
        self.templates = RequestTemplates.from_settings(settings)
        self._counter: Counter | None = None
        self._counter_lock = asyncio.Lock()

    async def counter(self) -> Counter:
        if self._counter is None:
            async with self._counter_lock:
                if self._counter is None:
                    self._counter = await self._load_counter()
        return self._counter

    async def _load_counter(self) -> Counter:
        source = self._settings.tokenizer or self._settings.model
        if source is None:
            listing = self.cached or await self.refresh()
            source = listing.root or (listing.ids[0] if listing.ids else None)
        if source is not None:
            try:
                loop = asyncio.get_running_loop()
                tokenizer = await loop.run_in_executor(self._executor, load_tokenizer, source)
                log.info("counting tokens with the tokenizer of %s", source)
                self._metrics.record_tokenizer_fallback(False)
                # Media parts cannot be counted locally; the engine's /tokenize counts those requests.
                return LocalCounter(
                    tokenizer, self._executor, fallback=self._remote(), templates=self.templates,
                    longest=self._longest_prompt,
                )
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
        if self.cached is None:
            await self.refresh()
        return self._remote()

    def _longest_prompt(self) -> int | None:
        """The gateway's context length as the served listing says now (None until known): longer prompts are
        refused or cut, so the counter caches nothing of them."""
        listing = self.cached
        return effective_max_model_len(listing.max_model_len if listing else None, self._settings.max_model_len)

    def _remote(self) -> RemoteCounter:
        listing = self.cached
        ids = listing.ids if listing is not None else ()
        model = self._settings.served_model_name or (ids[0] if ids else "")
        return RemoteCounter(self._upstream.tokenize, model, templates=self.templates)
