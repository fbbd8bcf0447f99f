"""Every kind of message crosses as itself; one whose fields are not of their types is refused on arrival. A
refusal crosses from the authority to a worker as the same error, with the same fields; a prompt's ids cross as
64-bit integers (their bytes in hex), or not at all when no engine would accept them."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import errors
from gateway.admission.destination import Destination
from gateway.admission.ledger import Capacity
from gateway.admission.prefix import PromptPrefix
from gateway.engine.vllm_api import ServedModel
from gateway.workers.codec import Malformed
from gateway.workers.messages import (
    Access,
    Admit,
    Admitted,
    Alive,
    Booking,
    Charge,
    End,
    EngineState,
    ErrorData,
    Message,
    MetricsAsk,
    MetricsReply,
    Progress,
    Refused,
    Rejected,
    Release,
    Serving,
    State,
    SupervisorState,
    Withdraw,
    crossing_prefix,
    decode,
    encode,
    error_data,
    error_of,
)

BOOKING = Booking("client-id", 16, 32, 2, 3, "search", 1.5, crossing_prefix(PromptPrefix((1, 2, 3), "tiny")),
                  ("e0",), "tiny/chat", 2.5, 0.8, 4)
STATE = State(
    (EngineState(False, None, "http://e0", error_data(errors.UpstreamHung("hung", retry_after=5.0)), True, "fp",
                 (ServedModel("tiny", "/m", 2048, None),)),
     EngineState(True, "no progress", "http://e1", None, False, None, None)),
    (SupervisorState("ready", 5.0, "http://e0"),), Capacity(512, 16, "engine"), True,
)
EVERY_KIND: list[Message] = [
    Admit(1, BOOKING, Charge("search", 16, 64)), Admit(2, BOOKING, None), Withdraw(3),
    Progress({1: 40, 2: 7}, {0: (1, -2, 3)}, {0: "fp", 1: None}, {2: 0.125}), Release(4, True, 30),
    Release(4, True, 1, 0.25), End(5, 12.5), End(6, 0.0, (False, 3, None)), End(6, 0.0, (True, 1, 0.5)),
    Rejected("search", "queue_full"), Serving(),
    Access("time=2026-12-05T07:00:00.000Z request_id=r status=200\n"),
    MetricsReply(6, (["vllm_guard_requests", "counter", "doc", "", [["x_total", {"route": "chat"}, 3.0]]],)),
    Admitted(7, 0.5, {"x-ratelimit-remaining-requests": "3"}, Destination("e0", 0, None)), Admitted(8, 0.0, {}, None),
    Refused(9, error_data(errors.QueueFull("The queue is full.", retry_after=3.0)), {}), Refused(10, None, {}),
    STATE, MetricsAsk(11), Alive(),
]


def through(message: Message) -> Message:
    return decode(orjson.loads(orjson.dumps(encode(message), option=orjson.OPT_NON_STR_KEYS)))


@pytest.mark.parametrize("message", EVERY_KIND, ids=lambda m: type(m).__name__)
def test_every_kind_of_message_crosses_as_itself(message: Message) -> None:
    back = through(message)
    if isinstance(message, Admit):  # the ids arrive as 64-bit integers: compared as numbers
        assert isinstance(back, Admit) and back.booking.prefix is not None and BOOKING.prefix is not None
        assert list(back.booking.prefix.ids) == list(BOOKING.prefix.ids)
        assert back.booking.prefix.salt == "tiny" and back.key == message.key and back.charge == message.charge
        return
    assert back == message


TAIL = [[], "", None, None, 0]  # a booking's avoid, family, deadline, objective and min_output
MALFORMED = {
    "not a frame": {"type": "end", "id": 1},
    "an unknown kind": ["promote", []],
    "too few fields": ["end", [1]],
    "too many fields": ["end", [1, 2.0, 3]],
    "a string key": ["withdraw", ["client-id"]],
    "a bool for an int": ["withdraw", [True]],
    "a number for a bool": ["release", [1, 1, 3]],
    "a string header": ["admitted", [1, 0.0, {"a": 1}, None]],
    "an engine index that is no number": ["progress", [{}, {"zero": [1, 2, 3]}, {}]],
    "a move of two counts": ["progress", [{}, {"0": [1, 2]}, {}]],
    "ids as an array": ["admit", [1, ["r", 1, 1, 1, 0, "t", 1.0, [[1, 2], ""], *TAIL], None]],
    "ids that are no hex": ["admit", [1, ["r", 1, 1, 1, 0, "t", 1.0, ["0100000000000g00", ""], *TAIL], None]],
    "ids of a length that is no multiple of 8 bytes": ["admit", [1, ["r", 1, 1, 1, 0, "t", 1.0, ["010203", ""], *TAIL],
                                                                 None]],
    "an objective that is no number": ["admit", [1, ["r", 1, 1, 1, 0, "t", 1.0, None, [], "", None, "1", 0], None]],
}


@pytest.mark.parametrize("frame", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_message_whose_fields_are_not_of_their_types_is_refused(frame: object) -> None:
    with pytest.raises(Malformed):
        decode(orjson.loads(orjson.dumps(frame)))


@pytest.mark.parametrize(
    ("frame", "droppable"),
    [(["rejected", ["t", 1]], True), (["access", [1]], True), (["release", [1, "yes", 3]], False)],
)
def test_only_what_nothing_waits_on_may_be_dropped(frame: object, droppable: bool) -> None:
    with pytest.raises(Malformed) as caught:
        decode(frame)
    assert caught.value.droppable is droppable


ERRORS = [
    errors.QueueFull("The queue is full (1024 waiting).", retry_after=3.0),
    errors.TenantRateLimited("Rate limit reached for tenant 'a'.", limit="tokens_per_minute", retry_after=12.0),
    errors.KVBudgetExceeded("This request needs 40 KV blocks, more than the engine's whole budget of 28."),
    errors.UpstreamUnavailable("The engine is restarting; retry shortly.", code="upstream_restarting", retry_after=5),
    errors.InvalidRequest("x-guard-deadline-ms is below 1 ms.", param="x-guard-deadline-ms"),
]


@pytest.mark.parametrize("error", ERRORS, ids=[type(e).__name__ for e in ERRORS])
def test_an_error_crosses_as_the_same_class_with_the_same_fields(error: errors.GatewayError) -> None:
    refused = through(Refused(1, error_data(error), {}))
    assert isinstance(refused, Refused) and refused.error is not None
    back = error_of(refused.error)
    assert type(back) is type(error)
    assert vars(back) == vars(error) and str(back) == str(error)
    assert (back.code, back.reason, back.client_fault) == (error.code, error.reason, error.client_fault)


def test_an_unknown_class_becomes_a_retryable_unavailable() -> None:
    back = error_of(ErrorData("SomethingElse", {"message": "boom"}))
    assert isinstance(back, errors.UpstreamUnavailable) and back.retry_after == 1 and back.message == "boom"


@pytest.mark.parametrize(
    ("prefix", "crosses"),
    [
        (None, None),
        (PromptPrefix((1, 2, 3), "tiny"), [1, 2, 3]),
        (PromptPrefix((0, -1, 2**63 - 1, -(2**63)), "tiny"), [0, -1, 2**63 - 1, -(2**63)]),
        (PromptPrefix((), "tiny"), []),
        (PromptPrefix((1, 2**64), "tiny"), None),  # no engine accepts it; its blocks are never shared
        (PromptPrefix((1, "2"), "tiny"), None),  # type: ignore[arg-type]
    ],
)
def test_a_prompts_ids_cross_as_they_are(prefix: PromptPrefix | None, crosses: list[int] | None) -> None:
    admit = through(Admit(1, Booking("r", 3, 1, 1, 0, "t", 1.0, crossing_prefix(prefix), (), "", None, None, 0), None))
    assert isinstance(admit, Admit)
    got = admit.booking.prefix
    assert (None if got is None else list(got.ids)) == crosses


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=2048), st.text(max_size=8))
def test_any_ids_of_64_bits_cross_whole_and_in_order(ids: list[int], salt: str) -> None:
    booking = Booking("r", len(ids), 1, 1, 0, "t", 1.0, crossing_prefix(PromptPrefix(ids, salt)), (), "", None, None, 0)
    admit = through(Admit(1, booking, None))
    assert isinstance(admit, Admit) and admit.booking.prefix is not None
    assert list(admit.booking.prefix.ids) == ids and admit.booking.prefix.salt == salt
