"""Who may call what: client keys open the client routes, admin keys the admin routes (and the client ones);
with no client key configured the client routes are open, whatever admin key is set. Keys are compared in
constant time, against every accepted key."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from gateway.config import Settings
from gateway.errors import AuthenticationFailed
from gateway.http import auth
from gateway.http.auth import authenticate
from testing.gateway_thread import run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

CLIENT, ADMIN, WRONG = "client-key-3b8e", "admin-key-c41d", "wrong-key-77aa"

CONFIGS = {
    "no keys": {},
    "client keys only": {"api_key": [CLIENT, "other-client=3"]},
    "admin key only": {"admin_api_key": [ADMIN]},
    "both": {"api_key": [CLIENT, "other-client=3"], "admin_api_key": [ADMIN]},
}
PRESENTED = {"no key": None, "a wrong key": WRONG, "the client key": CLIENT, "the admin key": ADMIN}
OK, DENIED = "ok", "401"
# (configuration, presented key) -> (client route, admin route)
EXPECTED: dict[tuple[str, str], tuple[str, str]] = {
    ("no keys", "no key"): (OK, DENIED),
    ("no keys", "a wrong key"): (OK, DENIED),
    ("no keys", "the client key"): (OK, DENIED),
    ("no keys", "the admin key"): (OK, DENIED),
    ("client keys only", "no key"): (DENIED, DENIED),
    ("client keys only", "a wrong key"): (DENIED, DENIED),
    ("client keys only", "the client key"): (OK, DENIED),
    ("client keys only", "the admin key"): (DENIED, DENIED),
    ("admin key only", "no key"): (OK, DENIED),
    ("admin key only", "a wrong key"): (OK, DENIED),
    ("admin key only", "the client key"): (OK, DENIED),
    ("admin key only", "the admin key"): (OK, OK),
    ("both", "no key"): (DENIED, DENIED),
    ("both", "a wrong key"): (DENIED, DENIED),
    ("both", "the client key"): (OK, DENIED),
    ("both", "the admin key"): (OK, OK),
}
ROUTE_KIND = {False: "client route", True: "admin route"}
CASES = [
    pytest.param(config, presented, admin, expected[admin], id=f"{config}, {presented}, {ROUTE_KIND[admin]}")
    for (config, presented), expected in EXPECTED.items()
    for admin in (False, True)
]


def request_with(headers: dict[str, bytes] | None = None) -> Request:
    raw = [(k.encode("latin-1"), v) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw, "query_string": b""})


def bearer(key: str | None) -> dict[str, bytes]:
    return {} if key is None else {"authorization": f"Bearer {key}".encode()}


def outcome(call: Callable[[], object]) -> str:
    try:
        call()
    except AuthenticationFailed:
        return DENIED
    return OK


@pytest.mark.parametrize(("config", "presented", "admin", "expected"), CASES)
def test_the_auth_matrix(config: str, presented: str, admin: bool, expected: str) -> None:
    settings = Settings(**CONFIGS[config])
    request = request_with(bearer(PRESENTED[presented]))
    assert outcome(lambda: authenticate(settings, request, admin=admin)) == expected


@pytest.fixture(scope="module")
def sim(tokenizer: Any, tokenizer_dir: Any) -> Iterator[SimServer]:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), max_model_len=512, tokenizer=tokenizer)
    with run_sim_server(config) as server:
        yield server


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_auth_matrix_over_http(config: str, sim: SimServer, tokenizer_dir: Any) -> None:
    settings = Settings(tokenizer=str(tokenizer_dir), upstream=sim.url, **CONFIGS[config])
    client_routes = [
        ("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}, 200),
        ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                          "max_tokens": 1}, 200),
        ("GET", "/v1/models", None, 200),
        ("POST", "/tokenize", {"model": "tiny", "prompt": "x"}, 200),
        ("GET", "/guard/status", None, 200),
    ]
    # Not in managed mode: past authentication, a restart is refused as a bad request.
    admin_routes = [("POST", "/guard/restart", None, 400)]
    wrong: list[str] = []
    with run_gateway(settings) as gw, httpx.Client(base_url=gw.url, timeout=10) as http:
        for presented, key in PRESENTED.items():
            for admin, routes in ((False, client_routes), (True, admin_routes)):
                expected = EXPECTED[(config, presented)][admin]
                for method, path, body, ok_status in routes:
                    r = http.request(method, path, json=body, headers=bearer(key))
                    want = ok_status if expected == OK else 401
                    if r.status_code != want:
                        wrong.append(f"{presented} on {method} {path}: {r.status_code}, expected {want}: {r.text}")
                    elif want == 401:
                        assert r.json()["error"]["type"] == "authentication_error"
                        assert r.json()["error"]["code"] == "invalid_api_key"
        # Open routes stay open whatever is configured.
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
    assert not wrong, "\n".join(wrong)


class CountingCompare:
    def __init__(self) -> None:
        self.calls = 0
        self._real = hmac.compare_digest

    def __call__(self, a: bytes, b: bytes) -> bool:
        assert isinstance(a, bytes) and isinstance(b, bytes), "keys are compared as bytes"
        self.calls += 1
        return self._real(a, b)


@pytest.mark.parametrize(
    ("presented", "admin", "compared"),
    [
        pytest.param(CLIENT, False, 4, id="the first client key is still compared with every key"),
        pytest.param(WRONG, False, 4, id="a wrong key is compared with every key"),
        pytest.param(ADMIN, False, 4, id="the admin key on a client route is compared with every key"),
        pytest.param(ADMIN, True, 1, id="an admin route compares with the admin keys only"),
        pytest.param("", False, 0, id="no key is compared with nothing"),
    ],
)
def test_every_accepted_key_is_compared_with_compare_digest(
    monkeypatch: pytest.MonkeyPatch, presented: str, admin: bool, compared: int
) -> None:
    counter = CountingCompare()
    monkeypatch.setattr(auth.hmac, "compare_digest", counter)
    settings = Settings(api_key=[CLIENT, "k2=5", "k3"], admin_api_key=[ADMIN])
    outcome(lambda: authenticate(settings, request_with(bearer(presented)), admin=admin))
    assert counter.calls == compared


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param({"authorization": b"Bearer k2"}, "k2", id="a bearer token, priority suffix stripped"),
        pytest.param({"authorization": b"bearer   k2  "}, "k2", id="the scheme in any case, spaces trimmed"),
        pytest.param({"x-api-key": b"k2"}, "k2", id="the x-api-key header"),
        pytest.param({"authorization": b"Basic azI6"}, None, id="another scheme is no key"),
        pytest.param({"authorization": "Bearer clé-секрет".encode()}, "clé-секрет", id="a non-ASCII key sent as UTF-8"),
        pytest.param({"authorization": b"Bearer k2 "}, "k2", id="a trailing space"),
        pytest.param({"authorization": b"Bearer k"}, None, id="a prefix of a key"),
        pytest.param({"authorization": b"Bearer k22"}, None, id="a key with one more character"),
    ],
)
def test_which_key_a_request_presents(headers: dict[str, bytes], expected: str | None) -> None:
    settings = Settings(api_key=["k2=5", "clé-секрет"])
    request = request_with(headers)
    if expected is None:
        with pytest.raises(AuthenticationFailed):
            authenticate(settings, request)
    else:
        assert authenticate(settings, request) == expected
        assert settings.key_priorities()[expected] == (5 if expected == "k2" else 0)


@pytest.mark.parametrize(
    ("config", "headers", "admin", "words"),
    [
        pytest.param(CONFIGS["client keys only"], {}, False, "Missing API key", id="missing client key"),
        pytest.param(CONFIGS["client keys only"], bearer(WRONG), False, "Incorrect API key", id="wrong client key"),
        pytest.param(CONFIGS["both"], {}, True, "Missing admin key", id="missing admin key"),
        pytest.param(CONFIGS["both"], bearer(CLIENT), True, "Incorrect admin key", id="a client key on an admin route"),
        pytest.param(CONFIGS["client keys only"], bearer(CLIENT), True, "none is configured",
                     id="an admin route with no admin key configured"),
    ],
)
def test_a_refusal_says_why_and_never_echoes_the_key(
    config: dict[str, Any], headers: dict[str, bytes], admin: bool, words: str
) -> None:
    with pytest.raises(AuthenticationFailed) as info:
        authenticate(Settings(**config), request_with(headers), admin=admin)
    assert words in info.value.message
    for key in (CLIENT, ADMIN, WRONG):
        assert key not in info.value.message
