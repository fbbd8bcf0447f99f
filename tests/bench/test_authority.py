"""The authority micro-benchmark prices each batch size it was asked for, and finds the authority holding nothing
once every request's frames were handed to it."""

from __future__ import annotations

import pytest

from bench.workloads import authority


def test_every_batch_size_is_priced_with_its_loop_turns_and_the_admission_alone() -> None:
    figures = authority.measure(200, [1, 4], prompt_tokens=30)
    assert set(figures) == {"alone", "authority_b1", "turns_b1", "authority_b4", "turns_b4"}
    assert all(v > 0 for v in figures.values())
    assert figures["turns_b4"] < figures["turns_b1"] < figures["authority_b1"]


def test_an_authority_that_kept_a_request_is_reported_not_priced(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.workers import authority as side
    from gateway.workers.messages import End

    monkeypatch.setitem(side._HANDLERS, End, lambda link, msg: None)  # ends never heard: requests kept
    with pytest.raises(RuntimeError, match="still holds"):
        authority.measure(50, [1], prompt_tokens=30)
