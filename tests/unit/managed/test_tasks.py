"""Owned tasks are kept while they run and cancelled and awaited on close; a failure is logged, not lost."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.managed.tasks import OwnedTasks


async def test_close_cancels_and_awaits_every_running_task() -> None:
    tasks = OwnedTasks()
    ended: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append(name)

    a, b = tasks.spawn(forever("a")), tasks.spawn(forever("b"))
    await asyncio.sleep(0)
    assert len(tasks) == 2
    await tasks.close()
    assert sorted(ended) == ["a", "b"]
    assert a.cancelled() and b.cancelled()
    assert len(tasks) == 0


async def test_a_finished_task_is_forgotten() -> None:
    tasks = OwnedTasks()

    async def quick() -> None:
        return None

    await tasks.spawn(quick())
    await asyncio.sleep(0)
    assert len(tasks) == 0


async def test_a_task_started_while_closing_is_closed_too() -> None:
    tasks = OwnedTasks()
    late: list[asyncio.Task[None]] = []

    async def spawns_on_cancel() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            late.append(tasks.spawn(asyncio.sleep(3600)))
            raise

    tasks.spawn(spawns_on_cancel())
    await asyncio.sleep(0)
    await tasks.close()
    assert late and late[0].cancelled()


async def test_close_from_an_owned_task_does_not_wait_for_itself() -> None:
    tasks = OwnedTasks()

    async def closer() -> None:
        await tasks.close()

    await asyncio.wait_for(tasks.spawn(closer()), 5)


async def test_a_failure_nobody_awaits_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    tasks = OwnedTasks()

    async def fails() -> None:
        raise RuntimeError("boom")

    task = tasks.spawn(fails())
    await asyncio.wait({task})
    await asyncio.sleep(0)
    assert any(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)
    assert len(tasks) == 0
