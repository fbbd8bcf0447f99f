"""A reservation's life: entered once, released exactly once on every path, and what its release teaches."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.reservation import Phase, Reservation
from tests.unit.admission.rig import Rig, enter, settle


# -- the ledger returns to zero on every path ------------------------------------------------------
async def test_an_exception_inside_the_context_releases() -> None:
    rig = Rig()
    with pytest.raises(ValueError, match="upstream broke"):
        async with rig.req(5):
            assert rig.adm.committed == 5
            raise ValueError("upstream broke")
    rig.assert_drained()


async def test_release_is_idempotent_on_every_path() -> None:
    rig = Rig()
    other = await rig.req(3).__aenter__()
    async with rig.req(5) as r:
        r.release()
        r.release()
        assert rig.adm.committed == 3
    assert rig.adm.committed == 3
    other.release()
    rig.assert_drained()


async def test_cancellation_while_queued_leaves_the_queue() -> None:
    rig = Rig()
    holder = await rig.req(10).__aenter__()
    waiting = enter(rig.req(2))
    await settle()
    assert rig.adm.queued == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert rig.adm.queued == 0
    holder.release()
    async with rig.req(10):
        assert rig.adm.committed == 10
    rig.assert_drained()


async def test_cancellation_in_the_instant_of_admission_releases_the_blocks() -> None:
    rig = Rig()
    holder = await rig.req(10).__aenter__()
    late = rig.req(4)
    waiting = enter(late)
    await settle()
    holder.release()  # admits `late`, whose task has not run yet
    assert late.admitted
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    rig.assert_drained()


async def test_releasing_a_queued_reservation_withdraws_it() -> None:
    rig = Rig()
    holder = await rig.req(10).__aenter__()
    queued = rig.req(1)
    waiting = enter(queued)
    await settle()
    queued.release()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    holder.release()
    rig.assert_drained()


async def test_a_reservation_enters_once() -> None:
    rig = Rig()
    r = rig.req(1)
    async with r:
        with pytest.raises(RuntimeError, match="already entered"):
            await r.__aenter__()
    rig.assert_drained()


# -- what a release teaches ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("how", "learned"), [("completed", {"/<=32": 8}), ("cut-short", {}), ("exception", {})],
)
async def test_only_completed_requests_teach_the_output_estimate(how: str, learned: dict[str, int]) -> None:
    rig = Rig()
    for _ in range(8):
        if how == "exception":
            with pytest.raises(ValueError, match="cut"):
                async with rig.req(2) as r:
                    r.observe_output_tokens(8)
                    raise ValueError("cut")
        else:
            r = await rig.req(2).__aenter__()
            r.observe_output_tokens(8)
            r.release(completed=how == "completed")
    assert rig.adm.status()["output_lengths"] == learned
    rig.assert_drained()


# -- phases and transitions ---------------------------------------------------------------------------
async def test_phases_from_arrival_to_release() -> None:
    rig = Rig()
    holder = await rig.req(10).__aenter__()
    r = rig.req(1)
    assert r.phase is Phase.NEW and not r.admitted
    waiting = enter(r)
    await settle()
    assert r.phase is Phase.QUEUED and r.waited
    holder.release()
    await waiting
    assert r.phase is Phase.ADMITTED and r.admitted and r.waited
    r.release()
    assert r.phase is Phase.RELEASED and not r.admitted
    rig.assert_drained()


async def test_a_refused_reservation_is_rejected_and_its_release_is_harmless() -> None:
    rig = Rig()
    r = rig.req(11)
    with pytest.raises(Exception, match="needs 11 KV blocks"):
        await r.__aenter__()
    assert r.phase is Phase.REJECTED
    r.release()
    assert r.phase is Phase.REJECTED
    rig.assert_drained()


async def test_a_reservation_released_before_entering_can_no_longer_enter() -> None:
    rig = Rig()
    r = rig.req(1)
    r.release()
    assert r.phase is Phase.RELEASED
    with pytest.raises(RuntimeError, match="already entered or released"):
        await r.__aenter__()
    rig.assert_drained()


def test_transitions_outside_the_phase_diagram_are_refused() -> None:
    rig = Rig()
    r = rig.req(1)
    with pytest.raises(RuntimeError, match="cannot go from new to admitted"):
        r.admit(0.0)
    with pytest.raises(RuntimeError, match="cannot go from new to released"):
        r.finish()  # only an admitted reservation finishes; a new one is withdrawn
    r.withdraw()
    with pytest.raises(RuntimeError, match="cannot go from released to queued"):
        r.enqueue()
    with pytest.raises(RuntimeError, match="cannot go from released to rejected"):
        r.reject()
    assert r.phase is Phase.RELEASED


class RecordingAdmitter:
    """A stand-in controller: the reservation reaches it through ``enter``, ``leave`` and ``first_token``."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.first_tokens: list[float] = []

    def first_token(self, reservation: Reservation, seconds: float) -> None:
        self.first_tokens.append(seconds)

    async def enter(self, reservation: Reservation) -> None:
        self.calls.append(f"enter {reservation.request_id}")

    def leave(self, reservation: Reservation) -> None:
        self.calls.append(f"leave {reservation.request_id}")


def booking(admitter: RecordingAdmitter, clock: list[float], *, n: int = 1, max_tokens: int = 24) -> Reservation:
    return Reservation(
        admitter, prompt_tokens=8, max_tokens=max_tokens, n=n, priority=0, request_id="a", block_size=16,
        clock=lambda: clock[0], checkpoint_spacing=0.1,
    )


async def test_the_context_manager_enters_and_leaves_through_the_admitter() -> None:
    admitter = RecordingAdmitter()
    r = booking(admitter, [0.0])
    assert r.blocks == 2  # 8 + 24 tokens in blocks of 16
    with pytest.raises(ValueError, match="boom"):
        async with r:
            raise ValueError("boom")
    r.release()
    assert admitter.calls == ["enter a", "leave a", "leave a"]
    assert r.recount(8, sharing=False) == 2 and r.blocks == 4


@pytest.mark.parametrize(("said", "kept"), [(0, 0), (10, 10), (24, 24), (500, 24), (-5, 0)])
def test_what_a_request_surely_generates_is_kept_within_its_max_tokens(said: int, kept: int) -> None:
    r = Reservation(
        RecordingAdmitter(), prompt_tokens=8, max_tokens=24, n=1, priority=0, request_id="a", block_size=16,
        clock=lambda: 0.0, checkpoint_spacing=0.1, min_output=said,
    )
    assert r.min_output == kept


# -- progress and what it teaches ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("observed", "completed", "cut", "output"),
    [(9, True, False, 5), (9, False, False, None), (9, True, True, None), (None, True, False, None)],
)
def test_only_an_observed_complete_output_counts(
    observed: int | None, completed: bool, cut: bool, output: int | None
) -> None:
    r = booking(RecordingAdmitter(), [0.0], n=2)
    if observed is not None:
        r.observe_output_tokens(observed)
    if cut:
        r.observe_output_tokens(3)  # a lower count (a stale chunk) changes nothing
        r.release(completed=False)
    else:
        r.release(completed=completed)
    assert r.completed_output == output


@pytest.mark.parametrize(
    ("sent_at", "engine_seconds"),
    [
        (None, 3.0),  # never said it was sent: counted from its admission
        (12.5, 0.5),  # sent 2.5 s after its admission (a late loop, the body): the engine's time starts there
    ],
)
async def test_a_first_token_is_timed_from_the_request_s_write_to_its_engine(
    sent_at: float | None, engine_seconds: float
) -> None:
    admitter, clock = RecordingAdmitter(), [0.0]
    r = booking(admitter, clock)
    r.sent()  # before its admission: not sent to any engine yet, ignored
    r.enqueue()
    clock[0] = 10.0
    r.admit(waited_seconds=10.0)
    if sent_at is not None:
        clock[0] = sent_at
        r.sent()
        clock[0] = sent_at + 1.0
        r.sent()  # a second write (a resend) does not move the start
    clock[0] = 13.0
    r.observe_output_tokens(1)
    r.observe_output_tokens(2)  # only the first token is a sample
    assert admitter.first_tokens == [engine_seconds]


async def test_a_first_token_timed_where_the_request_was_written_is_taken_as_told() -> None:
    """A worker's request at the authority: the worker timed the engine from its own write; the authority's clock
    (its admission to the progress that brought the token) would count the crossing and the batching too."""
    admitter, clock = RecordingAdmitter(), [0.0]
    r = booking(admitter, clock)
    r.enqueue()
    clock[0] = 10.0
    r.admit(waited_seconds=10.0)
    clock[0] = 13.0
    r.observe_output_tokens(1, first_token_s=0.4)
    r.observe_output_tokens(2, first_token_s=9.0)  # only the first token is a sample
    assert admitter.first_tokens == [0.4]


def test_progress_checkpoints_are_credited_only_inside_the_snapshot_window() -> None:
    clock = [10.0]
    r = booking(RecordingAdmitter(), clock)
    r.observe_output_tokens(20)
    clock[0] = 10.05
    r.observe_output_tokens(30)  # closer than the spacing to the last checkpoint: not a checkpoint
    clock[0] = 10.2
    r.observe_output_tokens(40)
    assert r.generated == 40
    r.credit(10.1, window=0.5)
    assert r.credited == 20 - (2 + 2 * 1)  # streamed progress runs ahead of the cache
    r.credit(10.3, window=0.5)
    assert r.credited == 40 - 4
    r.credit(20.0, window=0.5)
    assert r.credited is None  # no progress seen near that snapshot
    r.credit(10.3, window=0.5)
    r.forget_credit()
    assert r.credited is None


async def test_how_a_request_ended_is_fixed_by_its_first_release() -> None:
    # A stream's end gives its reservation back complete; the request path's own exit after it (an exception as
    # the answer closes) or a later cut-short release changes nothing of what admission learned.
    rig = Rig()
    r = await rig.req(1).__aenter__()
    r.observe_output_tokens(4 * r.n)
    r.release()
    await r.__aexit__(RuntimeError, RuntimeError("the answer closed"), None)
    r.release(completed=False)
    assert r.phase is Phase.RELEASED and r.completed_output == 4
