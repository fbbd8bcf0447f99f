"""A stream's output is counted from the engine's own figures: with the per-request ``stream_interval: 1000``
vLLM sends hundreds of tokens in one event, and the tenant's usage, its per-minute window and the reservation
(what admission learns of output lengths) all get the engine's true count. The client receives the stream
vLLM would have sent it: no usage chunk, no per-chunk usage and the system fingerprint where vLLM puts it, unless
it asked for usage itself."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.admission import Reservation
from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

OUTPUT = 600  # the engine stops every answer here
KEY, ADMIN = "sk-usage-tenant-01", "sk-usage-admin-02"
FINGERPRINT = "vllm-0.32.0-0f1e2d3c"
KEYS = f"""\
tenants:
  app:
    limits: {{tokens_per_minute: 1000000}}
    keys: [{KEY}]
"""


@pytest.fixture(scope="module")
def sim(tokenizer: Any, tokenizer_dir: Path) -> Iterator[SimServer]:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, max_model_len=2048,
                       num_blocks=512, block_size=16, stop_early=lambda index, max_tokens: OUTPUT,
                       system_fingerprint=FINGERPRINT)
    with run_sim_server(config) as server:
        yield server


@pytest.fixture(scope="module")
def gw(sim: SimServer, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(KEYS, encoding="utf-8")
    settings = Settings(tokenizer=str(tokenizer_dir), scrape_interval=0.05, queue_timeout=5.0, read_timeout=5.0,
                        upstream=sim.url, keys_file=str(keys), admin_api_key=[ADMIN])
    with run_gateway(settings) as server:
        yield server


@dataclass(frozen=True)
class Stream:
    id: str
    route: str
    options: dict[str, Any] | None  # the client's stream_options
    n: int = 1
    interval: int | None = 1000
    reads: tuple[bool, bool] | None = None  # how vLLM reads options that are not JSON booleans

    @property
    def asked(self) -> tuple[bool, bool]:
        """What the client asked as vLLM reads it: the usage chunk, usage on every chunk."""
        if self.reads is not None:
            return self.reads
        options = self.options or {}
        return bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 1000, "n": self.n, "stream": True}
        if self.route == "chat":
            body["messages"] = [{"role": "user", "content": "count for me"}]
        else:
            body["prompt"] = "count for me"
        if self.interval is not None:
            body["stream_interval"] = self.interval
        if self.options is not None:
            body["stream_options"] = self.options
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.route == "chat" else "/v1/completions"


USAGE, CONTINUOUS = {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}
STREAMS = [
    Stream("chat, no usage asked", "chat", None),
    Stream("chat, usage asked", "chat", USAGE),
    Stream("chat, continuous usage asked", "chat", CONTINUOUS),
    Stream("chat, n=3, no usage asked", "chat", None, n=3),
    Stream("chat, one token an event", "chat", None, interval=None),
    Stream("completions, no usage asked", "completions", None),
    Stream("completions, n=2, usage asked", "completions", USAGE, n=2),
    Stream("chat, usage declined as 0", "chat", {"include_usage": 0}, reads=(False, False)),
    Stream('chat, usage declined as "false"', "chat", {"include_usage": "false"}, reads=(False, False)),
    Stream('completions, usage declined as "no"', "completions", {"include_usage": "no"}, reads=(False, False)),
    Stream("chat, continuous 1 without usage", "chat", {"continuous_usage_stats": 1}, reads=(False, False)),
    Stream('chat, usage asked as "yes"', "chat", {"include_usage": "yes"}, reads=(True, False)),
    Stream("chat, n=2, usage declined as 0", "chat", {"include_usage": 0}, n=2, reads=(False, False)),
]


class Capturing:
    """The gateway's admission, keeping every reservation it makes. A stand-in put in the gateway's parts, not a
    method replaced on the admission itself: compiled (``gateway/native.py``), it refuses that. It answers
    ``isinstance`` as the admission (the parts check it) and hands everything else to it."""

    def __init__(self, admission: Any) -> None:
        self.admission = admission
        self.made: list[Reservation] = []

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self.admission)

    def reservation(self, **kw: Any) -> Reservation:
        r: Reservation = self.admission.reservation(**kw)
        self.made.append(r)
        return r

    def __getattr__(self, name: str) -> Any:
        return getattr(self.admission, name)


@pytest.fixture
def made(gw: GatewayServer) -> Iterator[list[Reservation]]:
    """The reservations the gateway makes while the test runs."""
    admission = gw.parts.admission
    capturing = Capturing(admission)
    gw.parts.admission = capturing
    try:
        yield capturing.made
    finally:
        gw.parts.admission = admission


def completion_tokens(gw: GatewayServer) -> int:
    r = httpx.get(gw.url + "/guard/usage", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return int(r.json()["tenants"]["app"]["completion_tokens"])


def events(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e]


def normalised(stream: list[bytes]) -> list[bytes]:
    return [re.sub(rb'"created":\d+', b'"created":0', e) for e in stream]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in STREAMS])
def test_the_engines_count_is_learned_and_the_client_gets_what_vllm_would_send(
    gw: GatewayServer, sim: SimServer, case: Stream, made: list[Reservation]
) -> None:
    before = completion_tokens(gw)
    rid = f"usage-{abs(hash(case.id))}"
    headers = {"authorization": f"Bearer {KEY}", "x-request-id": rid}
    through = httpx.post(gw.url + case.path, json=case.body(), headers=headers, timeout=30)
    assert through.status_code == 200, through.text
    direct = httpx.post(sim.url + case.path, json=case.body(), headers={"x-request-id": rid}, timeout=30)
    # Byte for byte what vLLM sends this request directly (only the clock's second may differ).
    assert normalised(events(through.content)) == normalised(events(direct.content))
    chunks = [orjson.loads(e[6:]) for e in events(through.content) if e != b"data: [DONE]\n\n"]
    final, continuous = case.asked
    assert any(c["choices"] == [] for c in chunks) == final
    assert any("usage" in c for c in chunks if c["choices"]) == continuous
    last = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(last) == case.n
    assert all(("system_fingerprint" in c) == (not final) for c in last)
    gw.wait_ledger_empty()
    (reservation,) = made
    assert reservation.generated == case.n * OUTPUT
    assert reservation.phase.value == "released"
    assert reservation.completed_output == OUTPUT  # what admission learned as it was given back
    assert completion_tokens(gw) - before == case.n * OUTPUT


def test_a_responses_stream_is_settled_to_the_engines_figure(gw: GatewayServer, made: list[Reservation]) -> None:
    before = completion_tokens(gw)
    body = {"model": "tiny", "input": "count for me", "max_output_tokens": 1000, "stream": True}
    r = httpx.post(gw.url + "/v1/responses", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    gw.wait_ledger_empty()
    (reservation,) = made
    assert reservation.generated == OUTPUT and reservation.completed_output == OUTPUT
    assert completion_tokens(gw) - before == OUTPUT


# -- several choices: each ends where vLLM ends it -------------------------------------------------------------
CHOICE_LENGTHS = (4, 30, 12)  # choice i of every request stops after this many tokens, one token an event


@pytest.fixture(scope="module")
def apart_engine(tokenizer: Any, tokenizer_dir: Path) -> Iterator[SimServer]:
    """An engine whose choices end apart, one token a step."""
    config = SimConfig(model="tiny", root=str(tokenizer_dir), tokenizer=tokenizer, max_model_len=2048,
                       num_blocks=512, block_size=16, token_delay=0.002, system_fingerprint=FINGERPRINT,
                       stop_early_choice=lambda index, choice, max_tokens: CHOICE_LENGTHS[choice])
    with run_sim_server(config) as server:
        yield server


def apart_settings(sim: SimServer, tokenizer_dir: Path) -> Settings:
    return Settings(tokenizer=str(tokenizer_dir), scrape_interval=0.05, queue_timeout=5.0, read_timeout=5.0,
                    upstream=sim.url)


@pytest.fixture(scope="module")
def apart(apart_engine: SimServer, tokenizer_dir: Path) -> Iterator[tuple[SimServer, GatewayServer]]:
    """That engine, and a gateway in front of it."""
    with run_gateway(apart_settings(apart_engine, tokenizer_dir)) as gw:
        yield apart_engine, gw


@pytest.mark.parametrize("route,options", [
    ("chat", None), ("chat", {"include_usage": "no"}), ("completions", {"continuous_usage_stats": 1}),
    ("chat", {"include_usage": True}),
], ids=["chat without usage", "chat, usage declined as 'no'", "completions, continuous alone", "chat with usage"])
def test_several_choices_come_in_vllms_order_each_ending_as_vllm_ends_it(
    apart: tuple[SimServer, GatewayServer], route: str, options: dict[str, Any] | None
) -> None:
    sim, gw = apart
    case = Stream("apart", route, options, n=len(CHOICE_LENGTHS), interval=None)
    httpx.post(gw.url + case.path, json=case.body(), timeout=30)  # an earlier stream: the fingerprint is known
    rid = f"apart-{route}-{abs(hash(str(options)))}"
    through = httpx.post(gw.url + case.path, json=case.body(), headers={"x-request-id": rid}, timeout=30)
    direct = httpx.post(sim.url + case.path, json=case.body(), headers={"x-request-id": rid}, timeout=30)
    assert through.status_code == direct.status_code == 200, through.text
    ends = [e for e in events(direct.content) if b'"finish_reason":"' in e]
    assert len(ends) == len(CHOICE_LENGTHS)
    # Choice 0 ends long before the others in vLLM's stream, and in the relayed one at the same place.
    assert normalised(events(through.content)) == normalised(events(direct.content))
    gw.wait_ledger_empty()


def without_fingerprint(event: bytes) -> bytes:
    return event.replace(b',"system_fingerprint":' + orjson.dumps(FINGERPRINT), b"")


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_the_first_stream_an_engine_serves_ends_each_choice_where_vllm_ends_it(
    apart_engine: SimServer, tokenizer_dir: Path, route: str
) -> None:
    """A gateway that has not yet seen the engine's fingerprint (no usage chunk told it): choice 0's end comes
    after its 4th token, before the other choices' next text, as vLLM sends it, not behind their 30. Only the
    ends of choices that end while others still run lack the fingerprint (not known yet); the last is stamped
    from the usage chunk right behind it."""
    case = Stream("first", route, None, n=len(CHOICE_LENGTHS), interval=None)
    rid = f"first-{route}"
    with run_gateway(apart_settings(apart_engine, tokenizer_dir)) as gw:
        through = httpx.post(gw.url + case.path, json=case.body(), headers={"x-request-id": rid}, timeout=30)
        gw.wait_ledger_empty()
    direct = httpx.post(apart_engine.url + case.path, json=case.body(), headers={"x-request-id": rid}, timeout=30)
    assert through.status_code == direct.status_code == 200, through.text
    last = CHOICE_LENGTHS.index(max(CHOICE_LENGTHS))
    expected = [e if b'"index":%d,' % last in e else without_fingerprint(e) for e in events(direct.content)]
    assert normalised(events(through.content)) == normalised(expected)
    ends = [e for e in events(through.content) if b'"finish_reason":"' in e]
    assert [b"system_fingerprint" in e for e in ends] == [False, False, True]
