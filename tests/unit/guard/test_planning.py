"""What a request says of its own length is booked as said: read as vLLM reads the fields, ``ignore_eos`` books
all of ``max_tokens`` and ``min_tokens`` books at least that much (never past ``max_tokens``); what vLLM refuses
books nothing more (the engine answers it with its 400)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.guard.endpoints.base import GuardedRequest
from gateway.guard.endpoints.table import BY_NAME
from gateway.guard.planning import sure_output

CASES: list[tuple[str, str, dict[str, Any], int]] = [
    ("nothing said", "chat", {}, 0),
    ("ignore_eos", "chat", {"ignore_eos": True}, 500),
    ("ignore_eos false", "chat", {"ignore_eos": False}, 0),
    ("ignore_eos as 1", "completions", {"ignore_eos": 1}, 500),
    ('ignore_eos as "yes"', "chat", {"ignore_eos": "yes"}, 500),
    ('ignore_eos as "off"', "chat", {"ignore_eos": "off"}, 0),
    ("ignore_eos vLLM refuses", "chat", {"ignore_eos": "maybe"}, 0),
    ("ignore_eos on responses", "responses", {"ignore_eos": True}, 500),
    ("min_tokens", "chat", {"min_tokens": 120}, 120),
    ('min_tokens as "120"', "completions", {"min_tokens": "120"}, 120),
    ("min_tokens as 120.0", "chat", {"min_tokens": 120.0}, 120),
    ("min_tokens past max_tokens", "chat", {"min_tokens": 900}, 500),
    ("min_tokens negative", "chat", {"min_tokens": -3}, 0),
    ("min_tokens vLLM refuses", "chat", {"min_tokens": 12.5}, 0),
    ("min_tokens on responses (not a field there)", "responses", {"min_tokens": 120}, 0),
    ("both", "chat", {"min_tokens": 120, "ignore_eos": True}, 500),
]


@pytest.mark.parametrize(("route", "body", "sure"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_what_a_request_surely_generates(route: str, body: dict[str, Any], sure: int) -> None:
    req = GuardedRequest(endpoint=BY_NAME[route], body=body, model="tiny", stream=False, n=1, max_tokens=None)
    assert sure_output(req, 500) == sure
