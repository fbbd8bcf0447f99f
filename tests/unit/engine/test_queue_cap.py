"""An engine whose own queue cap refused a request is full until it has room again, or a short hold passes."""

from __future__ import annotations

from gateway.engine.queue_cap import QueueCap
from gateway.engine.vllm_api import parse_metrics
from tests.support.clock import FakeClock


def test_an_engine_that_never_refused_is_not_full() -> None:
    assert QueueCap(FakeClock()).full is False


def test_a_refusal_makes_the_engine_full_for_the_hold() -> None:
    clock = FakeClock()
    cap = QueueCap(clock)
    cap.refused(1.0)
    clock.now += 0.99
    assert cap.full
    clock.now += 0.01
    assert not cap.full
    assert cap.status() == {"full": False, "refusals_total": 1}


def test_a_request_leaving_the_engine_gives_it_room_at_once() -> None:
    cap = QueueCap(FakeClock())
    cap.refused(5.0)
    cap.room()
    assert not cap.full


def test_a_later_refusal_starts_the_hold_again() -> None:
    clock = FakeClock()
    cap = QueueCap(clock)
    cap.refused(1.0)
    clock.now += 0.9
    cap.refused(1.0)
    clock.now += 0.9
    assert cap.full and cap.refusals_total == 2


def test_vllms_own_rejections_are_read_by_reason_under_either_spelling() -> None:
    for name in ("vllm:admission_rejections_total", "vllm:admission_rejections"):
        page = parse_metrics(
            f'{name}{{model_name="tiny",reason="max_num_queued_reqs"}} 3.0\n'
            f'{name}{{model_name="tiny",reason="max_num_queued_tokens"}} 1.0\n'
        )
        assert page.admission_rejections == {"max_num_queued_reqs": 3.0, "max_num_queued_tokens": 1.0}
        assert page.admission_rejections_total == 4.0
