"""Authentication: missing, wrong and oddly spelled keys on every kind of route, the key in x-api-key or as a
bearer token, admin routes, and a gateway with only an admin key."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.gateway_thread import run_gateway
from testing.hostile_checks import Case, Target, check_answer, raw_exchange, request_bytes, statuses, table
from testing.vllm_sim import SimServer

from .conftest import ADMIN_KEY, CLIENT_KEY, NORMAL_CHAT, PRIO_KEY, UPSTREAM_KEY, hostile_settings

CHAT = "/v1/chat/completions"
CHAT_BODY = json.dumps(NORMAL_CHAT).encode()
DENIED = statuses(401)
OK = statuses(200)


def call(id: str, *headers: tuple[str, str], path: str = CHAT, method: str = "POST",
         status: frozenset[int] = DENIED, body: bytes | None = CHAT_BODY) -> Case:
    code = "invalid_api_key" if status == DENIED else None
    return Case(id, body if method == "POST" else None, path, method, tuple(headers), status, code=code)


def bearer(key: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {key}")


NO_KEY = [
    call("no key on chat"),
    call("no key on completions", path="/v1/completions",
         body=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()),
    call("no key on responses", path="/v1/responses", body=json.dumps({"model": "tiny", "input": "hi"}).encode()),
    call("no key on embeddings", path="/v1/embeddings", body=json.dumps({"model": "tiny", "input": "hi"}).encode()),
    call("no key on models", path="/v1/models", method="GET"),
    call("no key on tokenize", path="/tokenize", body=json.dumps({"model": "tiny", "prompt": "hi"}).encode()),
    call("no key on detokenize", path="/detokenize", body=json.dumps({"model": "tiny", "tokens": [1]}).encode()),
    call("no key on guard status", path="/guard/status", method="GET"),
    call("no key on restart", path="/guard/restart", body=None),
    call("no key on a traversal out of v1", path="/v1/%2e%2e/metrics", method="GET", status=statuses(401, 404)),
]

SPELLINGS = [
    call("wrong key", bearer("sk-wrong")),
    call("bearer scheme alone", ("authorization", "Bearer")),
    call("lower-case scheme", ("authorization", f"bearer {CLIENT_KEY}"), status=OK),
    call("upper-case scheme", ("authorization", f"BEARER {CLIENT_KEY}"), status=OK),
    call("basic scheme with the key", ("authorization", "Basic " + base64.b64encode(f"x:{CLIENT_KEY}".encode()
                                                                                   ).decode())),
    call("token scheme with the key", ("authorization", f"Token {CLIENT_KEY}")),
    call("key alone without a scheme", ("authorization", CLIENT_KEY)),
    call("key with a suffix", bearer(CLIENT_KEY + "x")),
    call("key without its last character", bearer(CLIENT_KEY[:-1])),
    call("key upper-cased", bearer(CLIENT_KEY.upper())),
    call("key with a space inside", bearer(CLIENT_KEY[:5] + " " + CLIENT_KEY[5:])),
    call("key of 10 KB", bearer("k" * 10_000)),
    call("key in x-api-key", ("x-api-key", CLIENT_KEY), status=OK),
    call("wrong key in x-api-key", ("x-api-key", "sk-wrong")),
    call("wrong bearer beside a right x-api-key", bearer("sk-wrong"), ("x-api-key", CLIENT_KEY)),
    call("priority key", bearer(PRIO_KEY), status=OK),
    call("priority key spelled with its priority", bearer(f"{PRIO_KEY}=7")),
    call("admin key on a client route", bearer(ADMIN_KEY), status=OK),
    call("upstream key as a client key", bearer(UPSTREAM_KEY)),
    call("key in the query string", path=f"{CHAT}?api_key={CLIENT_KEY}"),
    call("key in a cookie", ("cookie", f"api_key={CLIENT_KEY}")),
]

ADMIN = [
    call("restart with a client key", bearer(CLIENT_KEY), path="/guard/restart", body=None,
         status=statuses(401, 403)),
    call("restart with a wrong key", bearer("sk-wrong"), path="/guard/restart", body=None),
    call("restart with the admin key outside managed mode", bearer(ADMIN_KEY), path="/guard/restart", body=None,
         status=statuses(400)),
    call("guard status with the admin key", bearer(ADMIN_KEY), path="/guard/status", method="GET", status=OK),
    call("guard status with a client key", bearer(CLIENT_KEY), path="/guard/status", method="GET", status=OK),
    call("health needs no key", path="/health", method="GET", status=OK),
    call("metrics need no key", path="/metrics", method="GET", status=OK),
]


@pytest.mark.parametrize("case", table([*NO_KEY, *SPELLINGS, *ADMIN]))
def test_a_key_is_checked_on_every_route(gw: Target, case: Case) -> None:
    r = gw.send(case, auth=False)
    check_answer(r.status_code, r.content, case)
    for secret in (CLIENT_KEY, PRIO_KEY, ADMIN_KEY, UPSTREAM_KEY):
        assert secret not in r.text, f"{case.id}: a key appears in the answer"
    gw.still_well()


RAW = [
    Case("empty bearer token", status=DENIED, headers=(("authorization", "Bearer "),)),
    Case("key bytes outside ascii", status=DENIED, headers=(("authorization", "Bearer \xff\xfe\xfd"),)),
    Case("two authorization headers, the first wrong", status=statuses(200, 401),
         headers=(bearer("sk-wrong"), bearer(CLIENT_KEY))),
    Case("authorization header of 20 KB", status=statuses(401, 431), headers=(bearer("z" * 20_000),)),
]


@pytest.mark.parametrize("case", table(RAW))
async def test_an_odd_authorization_header_is_refused_cleanly(gw: Target, case: Case) -> None:
    headers = [("content-type", "application/json"), ("connection", "close"), *case.headers]
    r = await raw_exchange(gw.url, request_bytes("POST", CHAT, headers, CHAT_BODY))
    assert r is not None
    check_answer(r.status, r.body, case)
    gw.still_well()


@pytest.fixture(scope="module")
def admin_only_gw(sim: SimServer, tokenizer_dir: Path) -> Iterator[Target]:
    settings = hostile_settings(tokenizer_dir, upstream=sim.url, upstream_api_key=UPSTREAM_KEY,
                                admin_api_key=[ADMIN_KEY])
    with run_gateway(settings) as server:
        target = Target(server, None, CHAT_BODY)
        yield target
        target.close()


ADMIN_ONLY = [
    call("chat is open when only an admin key is set", status=OK),
    call("models are open when only an admin key is set", path="/v1/models", method="GET", status=OK),
    call("restart still needs the admin key", path="/guard/restart", body=None),
    call("restart with a wrong admin key", bearer("sk-wrong"), path="/guard/restart", body=None),
    call("restart with the admin key", bearer(ADMIN_KEY), path="/guard/restart", body=None, status=statuses(400)),
]


@pytest.mark.parametrize("case", table(ADMIN_ONLY))
def test_an_admin_key_alone_guards_only_admin_routes(admin_only_gw: Target, case: Case) -> None:
    r = admin_only_gw.send(case, auth=False)
    check_answer(r.status_code, r.content, case)
    admin_only_gw.still_well()
