"""A large body's many small objects are freed in a worker, not on the event loop: ``offload.release`` empties the
list it is given on the loop for a small body and in a worker thread for a large one, and planning takes a
request's prompt sizes in one pass."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.guard import offload
from gateway.guard.counting import PromptTokens
from gateway.guard.planning import PromptSizes


class Item:
    """Records the thread it was freed on."""

    def __init__(self, freed_on: list[str]) -> None:
        self.freed_on = freed_on

    def __del__(self) -> None:
        self.freed_on.append(threading.current_thread().name)


@pytest.mark.parametrize(("body_bytes", "on_loop"), [
    pytest.param(200, True, id="an ordinary chat body: on the loop (a thread hop costs more)"),
    pytest.param(offload.INLINE_BODY_BYTES, True, id="at the inline limit: on the loop"),
    pytest.param(offload.INLINE_BODY_BYTES + 1, False, id="past it: in a worker"),
    pytest.param(7_000_000, False, id="a million one-token prompts: in a worker"),
])
async def test_a_released_list_is_emptied_and_its_items_freed_where_the_body_size_says(
    body_bytes: int, on_loop: bool
) -> None:
    loop_thread = threading.current_thread().name
    freed_on: list[str] = []

    async def request() -> list[Item]:
        offload.note_body(body_bytes)  # as the HTTP layer notes it, in the request's own task
        items = [Item(freed_on) for _ in range(3)]
        await offload.release(items)
        return items

    items = await asyncio.create_task(request())
    assert items == []
    assert len(freed_on) == 3
    assert all((name == loop_thread) is on_loop for name in freed_on), freed_on


@pytest.mark.parametrize(("counts", "sizes"), [
    pytest.param([7], PromptSizes(7, 7, 1), id="one prompt"),
    pytest.param([3, 9, 1], PromptSizes(13, 9, 3), id="a batch: the longest and the sum"),
    pytest.param([1] * 1000, PromptSizes(1000, 1, 1000), id="many one-token prompts"),
])
def test_a_requests_prompt_sizes_in_one_pass(counts: list[int], sizes: PromptSizes) -> None:
    assert PromptSizes.of([PromptTokens(c, None) for c in counts]) == sizes
