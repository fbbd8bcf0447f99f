"""What the vLLM simulator's handlers share (the app's in app.py, the Responses API's and pooling's in routes.py):
the refusal a handler raises, one request's run of engine sequences, responses that take over the raw ASGI
channel, and ``Handlers``, what the routes of routes.py use of the app.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from .dp import DataParallelSimulator
from .engine import Sequence, SimConfig, Simulator
from .text import PromptCounter


class Rejected(Exception):
    """A request vLLM answers with an error body."""

    def __init__(self, message: str, param: str | None = None, err_type: str = "BadRequestError",
                 status: int = 400, *, in_validator: bool = False) -> None:
        super().__init__(message)
        self.message, self.param, self.err_type, self.status = message, param, err_type, status
        # Raised by one of vLLM's pydantic model validators, so FastAPI's validation handler words it.
        self.in_validator = in_validator


class Run:
    """The engine sequences of one HTTP request and the token events they produce."""

    def __init__(self, total: int, stream: bool) -> None:
        self.seqs: list[Sequence] = []
        # The sequence whose output came first: the streaming usage reports its prefill stats.
        self.first: Sequence | None = None
        self.remaining = total
        self.finished = asyncio.Event()
        self.events: asyncio.Queue[tuple[Sequence | None, int, str | None]] | None = (
            asyncio.Queue() if stream else None
        )

    def on_token(self, seq: Sequence) -> None:
        if self.first is None:
            self.first = seq
        if self.events is not None:
            self.events.put_nowait((seq, seq.generated, seq.finish_reason))
        if seq.finish_reason is not None:
            self.remaining -= 1
            if self.remaining == 0:
                self.finished.set()


class _RawResponse(Response):
    """A Starlette response that hands the raw ASGI channel to a handler."""

    def __init__(self, handler: Callable[[Receive, Send], Awaitable[None]]) -> None:
        self.handler = handler
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(receive, send)


def asgi(handler: Callable[[Receive, Send], Awaitable[None]]) -> Response:
    return _RawResponse(handler)


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Handlers(Protocol):
    """What the routes of routes.py use of the app: its engine, configuration and counter, its error bodies and
    body reading, and the checks every generating route makes."""

    @property
    def sim(self) -> Simulator | DataParallelSimulator: ...

    @property
    def config(self) -> SimConfig: ...

    @property
    def counter(self) -> PromptCounter: ...

    def error(self, message: str, err_type: str = "BadRequestError", status: int = 400,
              param: str | None = None) -> JSONResponse: ...

    async def read_json(self, request: Request) -> dict[str, Any] | JSONResponse: ...

    def check_model(self, model: str | None) -> None: ...

    def kv_keys(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def prompt_ids(self, text: str, add_special_tokens: bool) -> list[int]: ...
