"""A starved client is told from a hostile one: the connection timeouts give a client back the time in which its
host starved work of a CPU (up to four times the timeout, or ``--starved-stretch`` times), and change nothing on an
idle host nor with ``--starved-stretch 0``; a stalled reader is cut at ``--write-timeout`` on an idle host, later
on a starved one, never while its socket has room."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from gateway.config import Settings
from gateway.errors import RequestTimeout
from gateway.http.body import BodyLimits, read_body
from gateway.http.limits import ConnectionLimits
from gateway.http.stall import WriteStall
from gateway.http.starved import STRETCH, owed
from gateway.observe.cpu_pressure import parse_some, starved_share

PSI = "some avg10=93.50 avg60=40.00 avg300=7.26 total=25591512\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


def share_of(value: float) -> Callable[[float], float]:
    return lambda window: value


@pytest.mark.parametrize(("limit", "elapsed", "share", "stretch", "expected"), [
    pytest.param(10.0, 10.0, 0.0, STRETCH, 0.0, id="an-idle-host-owes-nothing"),
    pytest.param(10.0, 10.0, 0.5, STRETCH, 5.0, id="half-of-the-wait-starved-is-owed-back"),
    pytest.param(10.0, 20.0, 0.5, STRETCH, 0.0, id="the-client-has-had-its-own-ten-seconds"),
    pytest.param(10.0, 10.0, 1.0, STRETCH, 10.0, id="a-fully-starved-wait-is-owed-whole"),
    pytest.param(10.0, 35.0, 1.0, STRETCH, 5.0, id="never-past-four-times-the-timeout"),
    pytest.param(10.0, 40.0, 1.0, STRETCH, 0.0, id="four-times-the-timeout-is-the-end"),
    pytest.param(10.0, 10.0, 0.001, STRETCH, 0.0, id="a-hundredth-of-a-second-is-not-worth-a-timer"),
    pytest.param(10.0, 10.0, 1.0, 0.0, 0.0, id="a-stretch-of-0-owes-nothing-on-a-starved-host"),
    pytest.param(10.0, 15.0, 1.0, 2.0, 5.0, id="a-stretch-of-2-ends-at-twice-the-timeout"),
])
def test_a_client_is_owed_the_time_its_host_starved_it(limit: float, elapsed: float, share: float, stretch: float,
                                                       expected: float) -> None:
    assert owed(limit, elapsed, share_of(share), stretch) == pytest.approx(expected)
    assert STRETCH == 4.0


@pytest.mark.parametrize(("stretch", "expected"), [(None, STRETCH), (0.0, 0.0), (2.5, 2.5)])
def test_the_stretch_reaches_every_connection_timeout_from_the_settings(stretch: float | None,
                                                                        expected: float) -> None:
    settings = Settings() if stretch is None else Settings(starved_stretch=stretch)
    limits = ConnectionLimits.of(settings)
    assert (limits.stretch, limits.body.stretch) == (expected, expected)


def test_the_host_pressure_is_read_from_psi_by_window(tmp_path: Path) -> None:
    psi = tmp_path / "cpu"
    psi.write_text(PSI)
    assert parse_some(PSI) == (pytest.approx(0.935), pytest.approx(0.40))
    assert starved_share(10.0, psi) == pytest.approx(0.935)
    assert starved_share(30.0, psi) == pytest.approx(0.40)


@pytest.mark.parametrize("text", ["", "full avg10=1.00 avg60=1.00 avg300=0 total=0\n", "some avg10=x avg60=1\n"])
def test_an_unreadable_pressure_counts_every_second_against_the_client(tmp_path: Path, text: str) -> None:
    psi = tmp_path / "cpu"
    psi.write_text(text)
    assert starved_share(10.0, psi) == 0.0
    assert starved_share(10.0, tmp_path / "missing") == 0.0


# -- the write timeout ---------------------------------------------------------------------------------


class Loop:
    """A loop whose clock is moved by the test and whose timers are run when due."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, Callable[[], None]]] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> Any:
        self.timers.append((self.now + delay, callback))
        return self

    def cancel(self) -> None:
        self.timers.clear()

    def run_until(self, when: float) -> None:
        while self.timers and min(t for t, _ in self.timers) <= when:
            due, callback = min(self.timers, key=lambda item: item[0])
            self.timers.remove((due, callback))
            self.now = due
            callback()
        self.now = when


class StalledTransport:
    """A client's connection whose reader holds ``held`` bytes unread."""

    def __init__(self, held: int = 1 << 20) -> None:
        self.held = held
        self.aborted_at: float | None = None
        self.loop: Loop | None = None

    def get_write_buffer_size(self) -> int:
        return self.held

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1)

    def abort(self) -> None:
        assert self.loop is not None
        self.aborted_at = self.loop.now


def stalled(share: float, ready: bool = False, stretch: float = STRETCH) -> tuple[Loop, StalledTransport]:
    loop, transport = Loop(), StalledTransport()
    transport.loop = loop
    stall = WriteStall(loop, 30.0, share=share_of(share), ready=lambda t: ready,  # type: ignore[arg-type]
                       stretch=stretch)
    stall.paused(transport)
    return loop, transport


def test_a_reader_that_stops_on_an_idle_host_is_cut_at_the_write_timeout() -> None:
    loop, transport = stalled(share=0.0)
    loop.run_until(29.9)
    assert transport.aborted_at is None
    loop.run_until(31.0)
    assert transport.aborted_at == pytest.approx(30.0)


def test_a_reader_on_a_starved_host_is_not_cut_at_the_write_timeout_but_still_is_later() -> None:
    loop, transport = stalled(share=0.9)
    loop.run_until(60.0)
    assert transport.aborted_at is None, "the host kept the client from running: it may not have read"
    loop.run_until(200.0)
    assert transport.aborted_at == pytest.approx(30.0 * STRETCH)


def test_a_reader_on_a_starved_host_is_cut_at_the_write_timeout_with_no_stretch() -> None:
    loop, transport = stalled(share=0.9, stretch=0.0)
    loop.run_until(31.0)
    assert transport.aborted_at == pytest.approx(30.0)


def test_a_reader_whose_socket_has_room_took_bytes_the_late_loop_has_not_moved() -> None:
    loop, transport = stalled(share=0.0, ready=True)
    loop.run_until(300.0)
    assert transport.aborted_at is None


def test_a_reader_that_takes_bytes_now_and_then_is_slow_not_stalled() -> None:
    loop, transport = stalled(share=0.0)
    for _ in range(5):
        loop.run_until(loop.now + 29.0)
        transport.held -= 1000
    loop.run_until(loop.now + 29.0)
    assert transport.aborted_at is None
    loop.run_until(loop.now + 60.0)
    assert transport.aborted_at is not None


# -- the body's limits in the app ------------------------------------------------------------------


def body_arriving(chunks: list[bytes]) -> Request:
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    return Request({"type": "http", "method": "POST", "headers": [], "path": "/"}, receive)


@pytest.mark.parametrize(("share", "stretch", "refused"), [
    pytest.param(0.0, STRETCH, True, id="idle-host-refused"),
    pytest.param(0.9, STRETCH, False, id="starved-host-read"),
    pytest.param(0.9, 0.0, True, id="starved-host-with-no-stretch-refused"),
])
async def test_a_body_late_while_its_host_starved_is_read_and_one_late_on_an_idle_host_is_not(
    share: float, stretch: float, refused: bool
) -> None:
    limits = BodyLimits(max_bytes=1 << 20, timeout=30.0, min_rate=1024.0, grace=5.0, stretch=stretch)
    times = iter([0.0, 1.0, 8.0])  # the start, the first chunk, the last one 8 s in: past 5 s + 2 KiB / 1 KiB/s
    request = body_arriving([b"x" * 1024, b"y" * 1024])
    if refused:
        with pytest.raises(RequestTimeout):
            await read_body(request, limits, clock=lambda: next(times), share=share_of(share))
    else:
        assert len(await read_body(request, limits, clock=lambda: next(times), share=share_of(share))) == 2048
