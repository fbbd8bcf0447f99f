"""Whether a request's CPU work runs on the event loop or in a worker thread, decided by the whole body's size.

Parsing, validation, chat rendering and counting cost time in proportion to the body, and not only to the
fields a check might measure: a 7 MB role, 7 MB of ``chat_template_kwargs`` or a million one-token prompts each
held the loop 2.4-7 s when only chosen fields decided (every client waited, streams and ``/health`` included).
So the HTTP layer notes the size of the body as it arrived (``note_body``), once per request, and every stage
asks ``inline()``: a body up to ``INLINE_BODY_BYTES`` is handled on the loop (a thread hop would cost more than
the work), anything larger in a worker. The size travels in a context variable because each request is served
by its own task, which the stages run in; code that never noted a size (tests, other callers) sees 0.

A worker thread holds the GIL while it runs Python or a C call that does not release it; the loop still gets
it every switch interval (5 ms) between bytecodes. The one long C call is the JSON parse: orjson took 0.13 s
for 8 MiB of one-token lists, but 0.4-0.6 s with the cyclic garbage collector running its full collections
over the growing list as it allocated. ``parse_json`` therefore pauses the collector for the parse of a large
body only, one parse at a time, so the pause is bounded by the longest parse.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import threading
from collections.abc import Callable
from typing import Any, TypeVar, TypeVarTuple

from gateway import jsonio

T = TypeVar("T")
Args = TypeVarTuple("Args")

# A body up to this many bytes is parsed, validated and counted on the loop. Measured here (2 busy cores): the
# worst such body (one-token prompt lists, the slowest to validate per byte) costs ~1-2 ms in all, a thread
# hop ~50-100 us; an ordinary chat body is a few hundred bytes.
INLINE_BODY_BYTES = 16 * 1024

_body_bytes: contextvars.ContextVar[int] = contextvars.ContextVar("vllm_guard_body_bytes", default=0)
# The collector is one per process: so is what pauses it. Parses of large bodies take turns (one at a time),
# so the collector runs between them whatever the load.
_parse_turn = threading.Lock()


def note_body(size: int) -> None:
    """Record the size of the request body being served, for the stages of this request's task."""
    _body_bytes.set(size)


def body_bytes() -> int:
    return _body_bytes.get()


def inline() -> bool:
    """Whether this request's CPU work is small enough to run on the event loop."""
    return _body_bytes.get() <= INLINE_BODY_BYTES


async def run(fn: Callable[[*Args], T], *args: *Args) -> T:
    """``fn(*args)`` on the loop for a small body, else in a worker thread."""
    if inline():
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def parse_json(raw: bytes, decode: Callable[[bytes], T]) -> T:
    """``decode(raw)``; for a large body with the cyclic collector paused (see the module's note)."""
    if len(raw) <= INLINE_BODY_BYTES:
        return decode(raw)
    with _parse_turn:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return decode(raw)
        finally:
            if was_enabled:
                gc.enable()


async def decode_body(raw: bytes, decode: Callable[[bytes], T]) -> T:
    """The body parsed by ``decode``: on the loop when small, else in a worker (``note_body`` first)."""
    note_body(len(raw))
    return await run(parse_json, raw, decode)


async def release(items: list[Any]) -> None:
    """Empty ``items``, the caller's last use of them: in a worker for a large body. Freeing the counted tokens of a
    million one-token prompts took ~75 ms of the loop's CPU (a /health waited behind it); a small list goes here."""
    if inline():
        items.clear()
    else:
        await asyncio.to_thread(items.clear)


async def dumps(data: Any) -> bytes:
    """``data`` as JSON for the engine; in a worker for a large body."""
    return await run(jsonio.dumps, data)
