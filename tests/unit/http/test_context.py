"""A guarded request's context is read once from its headers: a sane request id is kept and an odd one replaced,
the priority comes from the header or the key, the deadline and the request's own TTFT objective from their headers
(bounded, else a 400 naming the header), and the overflow policy from the header or the settings."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.datastructures import Headers
from starlette.requests import Request

from gateway.config import Settings
from gateway.errors import InvalidRequest
from gateway.http.context import (
    GuardedRequest,
    IndexedHeaders,
    deadline,
    objective,
    priority,
    prompt_policy,
    request_id,
)


def request(**headers: str) -> Request:
    raw = [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
    return GuardedRequest({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": raw})


@pytest.mark.parametrize(
    ("given", "kept"),
    [("abc-123", True), ("a.b:c_d", True), ("x" * 128, True), ("x" * 129, False), ("has space", False),
     ("", False), ("<script>", False)],
)
def test_a_sane_request_id_is_kept_and_any_other_is_replaced(given: str, kept: bool) -> None:
    req = request(x_request_id=given)
    rid = request_id(req)
    assert (rid == given) is kept and req.state.request_id == rid


def test_request_ids_made_by_the_gateway_differ() -> None:
    assert request_id(request()) != request_id(request())


@pytest.mark.parametrize(
    ("header", "key", "expected"),
    [(None, None, 0), ("5", None, 5), ("-3", "k1", -3), (None, "k1", 7), (None, "other", 0)],
)
def test_the_priority_comes_from_the_header_else_from_the_key(
    header: str | None, key: str | None, expected: int
) -> None:
    settings = Settings(api_key=["k1=7", "other"])
    headers = {"x_guard_priority": header} if header is not None else {}
    assert priority(settings, request(**headers), key) == expected


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("high", "x-guard-priority must be an integer; got 'high'"),
        ("1" * 40, f"x-guard-priority must be an integer from -2147483647 to 2147483647; got {'1' * 40}"),
        ("-2147483648", "x-guard-priority must be an integer from -2147483647 to 2147483647; got -2147483648"),
    ],
    ids=["not an integer", "40 digits (the workers' channel carries 64 bits)", "one past the range"],
)
def test_a_priority_that_is_not_an_integer_in_range_is_a_clear_400(given: str, said: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(said)) as caught:
        priority(Settings(), request(x_guard_priority=given), None)
    assert caught.value.param == "x-guard-priority"


def test_the_range_ends_are_priorities() -> None:
    for value in ("2147483647", "-2147483647"):
        assert priority(Settings(), request(x_guard_priority=value), None) == int(value)


@pytest.mark.parametrize(
    ("header", "default", "expected"),
    [(None, "reject", "reject"), (None, "truncate", "truncate"), ("truncate", "reject", "truncate"),
     ("reject", "truncate", "reject")],
)
def test_the_overflow_policy_comes_from_the_header_else_from_the_settings(
    header: str | None, default: str, expected: str
) -> None:
    headers = {"x_guard_on_overflow": header} if header is not None else {}
    assert prompt_policy(request(**headers), Settings(on_prompt_overflow=default)) == expected  # type: ignore[arg-type]


def test_an_unknown_overflow_policy_is_a_clear_400() -> None:
    with pytest.raises(InvalidRequest, match="must be 'reject' or 'truncate'; got 'drop'"):
        prompt_policy(request(x_guard_on_overflow="drop"), Settings())


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({}, None),
        ({"x_stainless_read_timeout": "600"}, 600.0),  # the OpenAI SDKs' default, on every request
        ({"x_stainless_read_timeout": "30.5"}, 30.5),
        ({"x_guard_deadline_ms": "2500"}, 2.5),
        ({"x_guard_deadline_ms": "2500", "x_stainless_read_timeout": "30"}, 2.5),  # the earlier of the two
        ({"x_guard_deadline_ms": "60000", "x_stainless_read_timeout": "30"}, 30.0),
    ],
)
def test_the_deadline_is_the_earliest_the_client_states(headers: dict[str, str], seconds: float | None) -> None:
    assert deadline(request(**headers)) == seconds


@pytest.mark.parametrize(
    ("header", "raw"),
    [("x-guard-deadline-ms", "soon"), ("x-guard-deadline-ms", "0"), ("x-guard-deadline-ms", "-5"),
     ("x-guard-deadline-ms", "nan"), ("x-guard-deadline-ms", "inf"), ("x-guard-deadline-ms", "86400001"),
     ("x-stainless-read-timeout", "abc"), ("x-stainless-read-timeout", "0"), ("x-stainless-read-timeout", "1e9")],
)
def test_a_deadline_header_out_of_bounds_is_a_400_naming_it(header: str, raw: str) -> None:
    with pytest.raises(InvalidRequest, match=f"{header} must be a number above 0") as caught:
        deadline(request(**{header.replace("-", "_"): raw}))
    assert caught.value.param == header


@pytest.mark.parametrize(
    ("header", "raw", "floor"),
    [("x-guard-deadline-ms", "0.0001", "1 ms"), ("x-guard-deadline-ms", "0.999", "1 ms"),
     ("x-guard-deadline-ms", "1e-9", "1 ms"), ("x-stainless-read-timeout", "0.0001", "0.001 s"),
     ("x-stainless-read-timeout", "0.0009", "0.001 s")],
)
def test_a_deadline_below_what_any_engine_can_meet_is_a_client_error_naming_the_header_and_the_floor(
    header: str, raw: str, floor: str
) -> None:
    """Not a 503 that the OpenAI SDKs would retry in vain: no engine answers within a millisecond, busy or idle."""
    with pytest.raises(InvalidRequest) as caught:
        deadline(request(**{header.replace("-", "_"): raw}))
    error = caught.value
    assert (error.param, error.code, error.retry_after, error.client_fault) == (
        header, "deadline_too_short", None, True
    )
    assert error.message.startswith(f"{header} is {raw} ") and f"the least any engine can meet: {floor}" in (
        error.message
    )


@pytest.mark.parametrize(
    ("header", "raw", "seconds"),
    [("x-guard-deadline-ms", "1", 0.001), ("x-stainless-read-timeout", "0.001", 0.001)],
)
def test_a_deadline_at_the_floor_is_taken(header: str, raw: str, seconds: float) -> None:
    assert deadline(request(**{header.replace("-", "_"): raw})) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({}, None),
        ({"x_llm_d_slo_ttft_ms": "2500"}, 2.5),  # the llm-d router's TTFT SLO, in milliseconds
        ({"x_llm_d_slo_ttft_ms": "250.5"}, 0.2505),
        ({"x_llm_d_slo_ttft_ms": "1"}, 0.001),  # at the floor
        ({"x_llm_d_slo_ttft_ms": "86400000"}, 86_400.0),  # a day
        ({"x_slo_ttft_ms": "800"}, 0.8),  # its deprecated name, which the router still reads
        ({"x_llm_d_slo_ttft_ms": "300", "x_slo_ttft_ms": "900"}, 0.3),  # the current name first, as the router reads
        ({"x_llm_d_slo_ttft_ms": "300", "x_slo_ttft_ms": "soon"}, 0.3),  # the other is not read at all
        ({"x_guard_deadline_ms": "300"}, None),  # a deadline is no objective
    ],
)
def test_the_objective_is_the_llm_d_routers_ttft_slo_in_milliseconds(
    headers: dict[str, str], seconds: float | None
) -> None:
    found = objective(request(**headers))
    assert found == (None if seconds is None else pytest.approx(seconds))


def test_an_objective_is_not_the_deadline() -> None:
    assert deadline(request(x_llm_d_slo_ttft_ms="300")) is None


@pytest.mark.parametrize(
    ("header", "raw"),
    [("x-llm-d-slo-ttft-ms", "soon"), ("x-llm-d-slo-ttft-ms", "0"), ("x-llm-d-slo-ttft-ms", "-5"),
     ("x-llm-d-slo-ttft-ms", "nan"), ("x-llm-d-slo-ttft-ms", "NaN"), ("x-llm-d-slo-ttft-ms", "inf"),
     ("x-llm-d-slo-ttft-ms", "86400001"), ("x-llm-d-slo-ttft-ms", "1e300"), ("x-llm-d-slo-ttft-ms", ""),
     ("x-slo-ttft-ms", "0"), ("x-slo-ttft-ms", "fast")],
)
def test_an_objective_header_out_of_bounds_is_a_400_naming_it(header: str, raw: str) -> None:
    with pytest.raises(InvalidRequest, match=f"{header} must be a number above 0 and at most 8.64e\\+07") as caught:
        objective(request(**{header.replace("-", "_"): raw}))
    assert (caught.value.param, caught.value.client_fault) == (header, True)


@pytest.mark.parametrize("raw", ["0.0001", "0.999", "1e-9"])
def test_an_objective_below_what_any_engine_can_meet_is_a_400_naming_the_header_and_the_floor(raw: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        objective(request(x_llm_d_slo_ttft_ms=raw))
    error = caught.value
    assert (error.param, error.code, error.retry_after) == ("x-llm-d-slo-ttft-ms", "deadline_too_short", None)
    assert error.message.startswith(f"x-llm-d-slo-ttft-ms is {raw} ms") and "least any engine can meet: 1 ms" in (
        error.message
    )


# -- the headers, indexed ---------------------------------------------------------------------------
NAMES = ["x-request-id", "X-Request-Id", "authorization", "content-length", "x-guard-priority", "traceparent", "a", "é"]
RAW_NAMES = st.sampled_from([*(n.lower().encode("latin-1") for n in NAMES), b"x-other", b"A"])
VALUES = st.binary(max_size=8).filter(lambda b: b"\r" not in b and b"\n" not in b)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(RAW_NAMES, VALUES), max_size=12), st.sampled_from([*NAMES, "x-other", "A", "missing"]))
def test_indexed_headers_answer_as_starlettes_scan_does(raw: list[tuple[bytes, bytes]], name: str) -> None:
    """Repeated headers (the first answers), any case asked, latin-1 names and values, absent ones."""
    scanned, indexed = Headers(raw=list(raw)), IndexedHeaders({"headers": list(raw)})
    assert indexed.get(name) == scanned.get(name)
    assert indexed.get(name, "d") == scanned.get(name, "d")
    assert (name in indexed) == (name in scanned)
    assert indexed.getlist(name) == scanned.getlist(name) and indexed.items() == scanned.items()
    if name in scanned:
        assert indexed[name] == scanned[name]
    else:
        with pytest.raises(KeyError):
            indexed[name]


def test_a_guarded_requests_headers_are_indexed_once() -> None:
    req = request(x_request_id="abc")
    assert isinstance(req.headers, IndexedHeaders) and req.headers is req.headers
