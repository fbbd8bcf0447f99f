"""The objective's governor: the requests in flight are capped so that the engine's own time to a first token
stays within its share of the TTFT objective (AIMD)."""

from __future__ import annotations

import pytest

from gateway.admission.governor import CUT, FLOOR, Governor
from tests.unit.admission.rig import Rig, enter, release_all, settle
from tests.unit.admission.test_deadlines import streamed_first_tokens


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_without_an_objective_nothing_is_capped() -> None:
    governor = Governor(None, Clock())
    governor.sample(60.0, 100)
    assert governor.limit is None and governor.allows(10_000)


@pytest.mark.parametrize(
    ("samples", "limit"),
    [
        ([(1.0, 50, 0.0)], None),  # within half the 4-s objective: no cap
        ([(3.0, 50, 0.0)], CUT * 50),  # over it: the cap is cut below what runs now
        ([(3.0, 50, 0.0), (3.0, 40, 0.5)], CUT * 50),  # one slow step is one signal: no second cut within 1 s
        ([(3.0, 50, 0.0), (3.0, 40, 1.5)], CUT * CUT * 50),  # still slow a second later: cut again
        ([(3.0, 50, 0.0), (3.0, 60, 1.5)], CUT * CUT * 50),  # cut from the cap, not from more than it allowed
        ([(3.0, 4, 0.0)], FLOOR),  # never below the floor
        ([(3.0, 50, 0.0), (1.0, 39, 0.1)], CUT * 50 + 1 / (CUT * 50)),  # fast while the cap binds: one more a round
        ([(3.0, 50, 0.0), (1.0, 20, 0.1)], CUT * 50),  # fast, but the cap does not bind: it stays
    ],
)
def test_the_cap_is_cut_on_slow_first_tokens_and_grows_back_while_it_binds(
    samples: list[tuple[float, int, float]], limit: float | None
) -> None:
    clock = Clock()
    governor = Governor(4.0, clock)
    for seconds, in_flight, at in samples:
        clock.now = at
        governor.sample(seconds, in_flight)
    assert governor.limit == (None if limit is None else pytest.approx(limit))


async def test_requests_past_the_cap_wait_in_the_queue_until_one_in_flight_ends() -> None:
    rig = Rig(queue_timeout=30.0, ttft_objective=2.0)
    running = await streamed_first_tokens(rig, 1.5, count=10)  # over half the objective: the cap falls to 8
    assert rig.adm.status()["deadlines"]["objective_concurrency_cap"] == pytest.approx(8.0)
    extra = rig.req(1)
    task = enter(extra)
    await settle()
    assert not extra.admitted  # 10 in flight, 8 allowed
    for r in running[:3]:
        r.release()
    await settle()
    assert extra.admitted
    await release_all(rig, [*running[3:], extra], [task])
