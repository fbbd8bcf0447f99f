"""Routes over HTTP: no form of a path reaches the engine unguarded, and the pass-through forwards only what
it should.

The simulator is wrapped in a recorder that keeps every request the engine receives and answers, like a
permissive engine would, every path the simulator does not serve. Requests are sent byte for byte (no HTTP
client normalises their paths first) with a unique ``x-request-id``, which the gateway forwards: so each
request the engine saw can be matched with the gateway's answer to it.
"""

from __future__ import annotations

import http.client
import itertools
import logging
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import orjson
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.config import GENERATING_ROUTES, Settings
from gateway.errors import NotFound
from gateway.http.routes import GATEWAY_ROUTES, GUARDED_ROUTES, PUBLIC_ROUTES, canonical_path
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server
from testing.vllm_sim import app as vllm_sim

# -- the recording engine ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    raw_path: bytes
    query: bytes
    headers: dict[str, str]

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")


class Recorder:
    """Records each request on its way into the simulator, adds a cookie to every answer, and answers the
    paths the simulator lacks itself (200 JSON, or a stream cut midway when ``x-test-cut`` asks for it)."""

    def __init__(self, app: Any) -> None:
        self.app: ASGIApp = app
        self.state = app.state
        self.served = {route.path for route in app.app.routes}
        self.seen: list[Seen] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.seen.append(Seen(scope["method"], scope["path"], scope.get("raw_path", b""), scope["query_string"],
                              headers))

        async def with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", b"engine=1")]}
            await send(message)

        if scope["path"] in self.served:
            await self.app(scope, receive, with_cookie)
        elif cut := headers.get("x-test-cut"):
            await self._cut(cut, receive, send)
        else:
            body = orjson.dumps({"object": "stub", "path": scope["path"]})
            await with_cookie({"type": "http.response.start", "status": 200,
                               "headers": [(b"content-type", b"application/json")]})
            await with_cookie({"type": "http.response.body", "body": body})

    @staticmethod
    async def _cut(kind: str, receive: Receive, send: Send) -> None:
        sse = kind == "sse"
        ctype = b"text/event-stream" if sse else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
        first = b'data: {"n": 1}\n\n' if sse else b'{"partial": '
        await send({"type": "http.response.body", "body": first, "more_body": True})
        await send({"type": "http.response.body", "body": b'data: {"par' if sse else b"[1, 2", "more_body": True})
        send.__self__.transport.abort()  # type: ignore[attr-defined]  # uvicorn's connection, reset
        while (await receive())["type"] != "http.disconnect":
            pass

    def generating(self) -> list[Seen]:
        """Requests that may make the engine generate or pool: everything but its public reading routes and
        the gateway's own scrapes."""
        reading = {("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/version"),
                   ("POST", "/tokenize"), ("POST", "/detokenize")}
        return [s for s in self.seen if (s.method, s.path) not in reading]


@dataclass
class Engine:
    server: SimServer
    recorder: Recorder


@pytest.fixture(scope="module")
def engine(tokenizer: Any, tokenizer_dir: Path) -> Iterator[Engine]:
    config = SimConfig(model="tiny", root=str(tokenizer_dir), max_model_len=512, num_blocks=256, block_size=16,
                       tokenizer=tokenizer)
    recorders: list[Recorder] = []

    def recorded(config: SimConfig) -> Recorder:
        recorders.append(Recorder(create(config)))
        return recorders[-1]

    create = vllm_sim.create_sim_app
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_sim, "create_sim_app", recorded)
        runner = run_sim_server(config)
    with runner as server:
        yield Engine(server, recorders[0])


def settings_for(engine: Engine, tokenizer_dir: Path, **kw: Any) -> Settings:
    return Settings(tokenizer=str(tokenizer_dir), upstream=engine.server.url, scrape_interval=0.05,
                    queue_timeout=5.0, read_timeout=5.0, **kw)


@pytest.fixture(scope="module")
def gateway(engine: Engine, tokenizer_dir: Path) -> Iterator[GatewayServer]:
    with run_gateway(settings_for(engine, tokenizer_dir)) as gw:
        yield gw


# -- a client that sends the path as given ----------------------------------------------------------
@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def guarded(self) -> bool:
        return "x-guard-prompt-tokens" in self.headers

    def refused_by_the_gateway(self) -> bool:
        if self.status not in (404, 405) or self.guarded:
            return False
        error = self.json()["error"]
        expected = {404: "not_found", 405: "method_not_allowed"}[self.status]
        return bool(error["code"] == expected and error["type"] == "invalid_request_error"
                    and set(error) == {"message", "type", "param", "code"})


_IDS = itertools.count(1)


def send_raw(url: str, method: str, target: bytes, body: bytes = b"", headers: dict[str, str] | None = None,
             ) -> tuple[str, Answer]:
    """One request on its own connection, its target written byte for byte; returns its request id."""
    rid = f"route-{next(_IDS)}"
    parts = urlsplit(url)
    lines = [method.encode() + b" " + target + b" HTTP/1.1", f"host: {parts.netloc}".encode(),
             f"x-request-id: {rid}".encode(), b"connection: close"]
    all_headers = {"content-type": "application/json", **(headers or {})}
    if body or method == "POST":
        all_headers["content-length"] = str(len(body))
    lines += [f"{k}: {v}".encode() for k, v in all_headers.items()]
    with socket.create_connection((parts.hostname, parts.port), timeout=15) as sock:
        sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        data = response.read()
        return rid, Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, data)


BODIES: dict[str, dict[str, Any]] = {
    "chat": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "completions": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
    "responses": {"model": "tiny", "input": "hi", "max_output_tokens": 2},
    "embeddings": {"model": "tiny", "input": "hi"},
    "pooling": {"model": "tiny", "input": "hi"},
    "classify": {"model": "tiny", "input": "hi"},
    "score": {"model": "tiny", "text_1": "hi", "text_2": "there"},
    "rerank": {"model": "tiny", "query": "hi", "documents": ["there"]},
}


def body_for(path: str) -> bytes:
    route = GUARDED_ROUTES.get(path)
    return orjson.dumps(BODIES[route] if route else {"model": "tiny", "prompt": "hi", "messages": [],
                                                     "max_tokens": 2})


# -- path forms -------------------------------------------------------------------------------------
# vLLM routes that are not in the gateway's table: admin, debugging and unguarded generation.
VLLM_ONLY = ["/openapi.json", "/docs", "/scale_elastic_ep", "/collective_rpc", "/sleep", "/pause",
             "/v1/load_lora_adapter", "/v1/chat/completions/batch", "/cohere/v2/chat", "/generative_scoring",
             "/v1/systemone", "/v2/embed", "/v1/chat/completions/render", "/reset_prefix_cache", "/server_info"]
TARGETS = [*GUARDED_ROUTES, *(r.path for r in GATEWAY_ROUTES), *PUBLIC_ROUTES, *GENERATING_ROUTES, *VLLM_ONLY]

# The issue's own forms: each went around the guard or out of /v1.
ISSUE_FORMS = [
    "/v1/./chat/completions", "/v1/x/../chat/completions", "/v1/%2e/chat/completions", "/v1/chat/./completions",
    "/v1/./completions", "/v1/%2e%2e/metrics", "/v1/%2e%2e/openapi.json", "/v1/%2e%2e/invocations",
    "/v1/%2e%2e/scale_elastic_ep", "/v1/%2E%2E/v1/chat/completions", "/v1/chat/completions/",
]


def _same_route(path: str, rng: random.Random) -> str:
    """A form the route table reads as the same route (or, climbing out of /v1, as another table path)."""
    segments = path.strip("/").split("/")
    at = rng.randrange(len(segments) + 1)
    kind = rng.randrange(7)
    if kind == 0:
        segments.insert(at, ".")
    elif kind == 1:
        segments.insert(at, rng.choice(["zz/..", "a/b/../..", "./zz/.."]))
    elif kind == 2:
        segments.insert(at, "")  # a double slash
    elif kind == 3:
        return "/" + "/".join(segments) + rng.choice(["/", "//", "/.", "/./", "?x=1", "#x"])
    elif kind == 4:
        return "//" + "/".join(segments)
    elif kind == 5:
        return "/v1/.." + path
    else:
        seg = rng.randrange(len(segments))
        word = segments[seg]
        if word:
            i = rng.randrange(len(word))
            segments[seg] = word[:i] + f"%{ord(word[i]):02{rng.choice('xX')}}" + word[i + 1:]
    return "/" + "/".join(segments)


def _hostile(path: str, rng: random.Random) -> str:
    """A form that is ambiguous, climbs out of the root, or is no table path at all."""
    segments = path.strip("/").split("/")
    at = rng.randrange(len(segments) + 1)
    kind = rng.randrange(9)
    if kind == 0:
        segments.insert(at, rng.choice(["%2e", "%2E", "%2e%2e", ".%2e", "%2E.", "%252e", "%252E%252E"]))
    elif kind == 1:
        return "/v1/" + rng.choice(["%2e%2e", "%2E%2e", "..;", "%252e%252e", "..%2f..", "..%5c", "%2e%2e%2f"]) + path
    elif kind == 2:
        return "/" + rng.choice(["%2f", "%2F", "%5c", "%5C", "\\"]).join(segments)
    elif kind == 3:
        seg = rng.randrange(len(segments))
        segments[seg] = segments[seg].upper()
    elif kind == 4:
        return rng.choice(["/..", "/../..", "/v1/../.."]) + path
    elif kind == 5:
        return path + rng.choice(["/..", ";x", "%00", "%0a", "%20", "%09", "%7f", "/zz", "-"])
    elif kind == 6:
        segments.insert(at, rng.choice(["%C0%AE%C0%AE", "%EF%BC%8E%EF%BC%8E", "%e2%80%a4", "%u002e"]))
    elif kind == 7:
        segments.insert(at, "a" * rng.choice([10, 600, 1100]))
    else:
        segments.insert(at, rng.choice(["..", "../.."]))
    return "/" + "/".join(segments)


def path_forms(count: int, seed: int = 10) -> list[str]:
    """The issue's forms, then forms of table paths and vLLM's own, each changed one to three times."""
    rng = random.Random(seed)
    forms = list(ISSUE_FORMS)
    while len(forms) < count:
        path = rng.choice(list(GUARDED_ROUTES)) if rng.random() < 0.4 else rng.choice(TARGETS)
        for _ in range(rng.randint(1, 3)):
            path = _hostile(path, rng) if rng.random() < 0.35 else _same_route(path, rng)
        forms.append(path)
    return forms


# -- the property -----------------------------------------------------------------------------------
def test_no_form_of_a_path_reaches_the_engine_unguarded(gateway: GatewayServer, engine: Engine) -> None:
    engine.recorder.seen.clear()
    answers: dict[str, tuple[str, str, Answer]] = {}
    for form in path_forms(360):
        methods = ("POST", "GET") if form in ISSUE_FORMS else (random.Random(form).choice(["POST", "POST", "GET"]),)
        for method in methods:
            body = body_for(_intended(form)) if method == "POST" else b""
            rid, answer = send_raw(gateway.url, method, form.encode(), body)
            answers[rid] = (method, form, answer)

    unexplained = []
    for rid, (method, form, answer) in answers.items():
        reached = [s for s in engine.recorder.seen if s.request_id == rid]
        if not (answer.refused_by_the_gateway() or answer.guarded or _answered_without_generation(form, reached)):
            unexplained.append((method, form, answer.status, answer.body[:200], [s.path for s in reached]))
    assert not unexplained, unexplained

    # What the engine received: table paths only, sent as such, and every generating request counted.
    allowed = {*GUARDED_ROUTES, *PUBLIC_ROUTES, "/metrics", "/v1/models", "/health"}
    for seen in engine.recorder.seen:
        assert seen.path in allowed and seen.raw_path == seen.path.encode(), seen
    generating = engine.recorder.generating()
    assert all(s.path in GUARDED_ROUTES and answers[str(s.request_id)][2].guarded for s in generating), generating
    gateway.wait_ledger_empty()

    # The run exercised both outcomes, not only refusals.
    outcomes = [a for _, _, a in answers.values()]
    assert sum(a.guarded and a.status == 200 for a in outcomes) >= 40
    assert sum(a.refused_by_the_gateway() for a in outcomes) >= 100


def _intended(form: str) -> str:
    """The table path a form reads as, or "" for a refused form."""
    try:
        path = form.partition("?")[0].partition("#")[0]  # as the HTTP server splits the target
        return canonical_path(path.encode(), unquote(path))
    except NotFound:
        return ""


def _answered_without_generation(form: str, reached: list[Seen]) -> bool:
    """The gateway's own routes answer themselves, the public reading routes reach only themselves, and a
    guarded request the guard refused (a 400 before counting) reaches nothing."""
    path = _intended(form)
    if path in {r.path for r in GATEWAY_ROUTES}:
        return all(s.path == "/v1/models" for s in reached)
    if path in PUBLIC_ROUTES:
        return all(s.path == path for s in reached)
    return path in GUARDED_ROUTES and not reached


ISSUE_CASES: list[tuple[str, str, str]] = [
    # form, expected outcome, what it went to before
    ("/v1/./chat/completions", "guarded", "chat unguarded"),
    ("/v1/x/../chat/completions", "guarded", "chat unguarded"),
    ("/v1/chat/./completions", "guarded", "chat unguarded"),
    ("/v1/./completions", "guarded", "completion unguarded"),
    ("//v1/chat/completions", "guarded", "chat"),
    ("/v1/chat/completions/", "guarded", "a redirect to chat"),
    ("/v1/%63hat/completions", "guarded", "chat"),
    ("/v1/%2e/chat/completions", "404", "chat unguarded"),
    ("/v1/%2e%2e/metrics", "404", "vLLM's /metrics"),
    ("/v1/%2e%2e/openapi.json", "404", "vLLM's /openapi.json"),
    ("/v1/%2e%2e/invocations", "404", "unguarded generation"),
    ("/v1/%2e%2e/scale_elastic_ep", "404", "an admin route"),
    ("/v1/..%2finvocations", "404", "unguarded generation"),
    ("/v1/../invocations", "404", "unguarded generation"),
    ("/v1/messages", "404", "unguarded generation"),
    ("/invocations", "404", "unguarded generation"),
    ("/inference/v1/generate", "404", "unguarded generation"),
    ("/v1/audio/transcriptions", "404", "unguarded generation"),
    ("/v1/chat/completions/batch", "404", "unguarded generation"),
    ("/v1/no-such-thing", "404", "vLLM's own 404"),
]


@pytest.mark.parametrize(("form", "outcome"), [c[:2] for c in ISSUE_CASES], ids=[c[0] for c in ISSUE_CASES])
def test_each_known_bypass_is_guarded_or_refused(gateway: GatewayServer, engine: Engine, form: str,
                                                  outcome: str) -> None:
    body = body_for(_intended(form) or "/v1/chat/completions")
    rid, answer = send_raw(gateway.url, "POST", form.encode(), body)
    reached = [s for s in engine.recorder.seen if s.request_id == rid]
    if outcome == "guarded":
        assert answer.status == 200 and answer.guarded, answer
        assert [s.path for s in reached] == [_intended(form)]
    else:
        assert answer.refused_by_the_gateway(), answer
        assert reached == []


def test_a_wrong_method_is_405_with_allow(gateway: GatewayServer) -> None:
    _, answer = send_raw(gateway.url, "GET", b"/v1/./chat/completions")
    assert answer.status == 405 and answer.headers["allow"] == "POST"
    assert answer.refused_by_the_gateway()
    _, answer = send_raw(gateway.url, "DELETE", b"/tokenize")
    assert answer.status == 405 and answer.headers["allow"] == "POST"


@pytest.mark.parametrize("target", [b"/v1/chat\x00/completions", b"/v1/\x7f/chat/completions",
                                    b"/v1/\xc3\xa9/chat/completions", b"/v1/\x01/../chat/completions"],
                         ids=["a NUL", "a DEL", "raw UTF-8", "a control character"])
def test_a_path_with_raw_control_bytes_never_reaches_the_engine(gateway: GatewayServer, engine: Engine,
                                                                 target: bytes) -> None:
    # The HTTP server may refuse these itself (400) before the gateway sees them.
    rid, answer = send_raw(gateway.url, "POST", target, body_for("/v1/chat/completions"))
    assert answer.status in (400, 404) and not answer.guarded
    assert not [s for s in engine.recorder.seen if s.request_id == rid]


# -- the pass-through -------------------------------------------------------------------------------
def test_the_clients_credentials_and_cookies_are_not_forwarded(engine: Engine, tokenizer_dir: Path) -> None:
    settings = settings_for(engine, tokenizer_dir, api_key=["client-key"], upstream_api_key="engine-key")
    with run_gateway(settings) as gw:
        credentials = {"x-api-key": "client-key", "cookie": "session=abc", "proxy-authorization": "Basic x"}
        body = orjson.dumps({"model": "tiny", "tokens": [1, 2]})
        rid, answer = send_raw(gw.url, "POST", b"/detokenize?add_special=1", body, credentials)
        assert answer.status == 200, answer
        [seen] = [s for s in engine.recorder.seen if s.request_id == rid]
        assert seen.path == "/detokenize" and seen.query == b"add_special=1"
        assert seen.headers["authorization"] == "Bearer engine-key"
        assert not {"x-api-key", "cookie", "proxy-authorization"} & set(seen.headers)
        assert "set-cookie" not in answer.headers

        rid, answer = send_raw(gw.url, "GET", b"/version", headers={"authorization": "Bearer client-key"})
        assert answer.status == 200 and answer.json()["version"]
        [seen] = [s for s in engine.recorder.seen if s.request_id == rid]
        assert seen.headers["authorization"] == "Bearer engine-key"
        assert "set-cookie" not in answer.headers

        _, answer = send_raw(gw.url, "GET", b"/version")
        assert answer.status == 401


def test_query_strings_reach_the_engine_only_on_pass_through_routes(gateway: GatewayServer, engine: Engine) -> None:
    rid, answer = send_raw(gateway.url, "POST", b"/v1/chat/completions?stream=true&x=1",
                           body_for("/v1/chat/completions"))
    assert answer.status == 200 and answer.guarded
    [seen] = [s for s in engine.recorder.seen if s.request_id == rid]
    assert seen.query == b""


def test_a_generating_route_is_404_by_default_and_forwarded_when_named(engine: Engine, tokenizer_dir: Path,
                                                                      gateway: GatewayServer) -> None:
    body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    rid, answer = send_raw(gateway.url, "POST", b"/v1/messages", body)
    assert answer.refused_by_the_gateway() and "--passthrough-route /v1/messages" in answer.json()["error"]["message"]
    assert not [s for s in engine.recorder.seen if s.request_id == rid]

    with run_gateway(settings_for(engine, tokenizer_dir, passthrough_route=["/v1/messages"])) as gw:
        rid, answer = send_raw(gw.url, "POST", b"/v1/./messages?beta=true", body)
        assert answer.status == 200 and answer.json() == {"object": "stub", "path": "/v1/messages"}
        [seen] = [s for s in engine.recorder.seen if s.request_id == rid]
        assert seen.raw_path == b"/v1/messages" and seen.query == b"beta=true"
        _, answer = send_raw(gw.url, "POST", b"/invocations", body)
        assert answer.refused_by_the_gateway()


@pytest.fixture(scope="module")
def messages_gateway(engine: Engine, tokenizer_dir: Path) -> Iterator[GatewayServer]:
    with run_gateway(settings_for(engine, tokenizer_dir, passthrough_route=["/v1/messages"])) as gw:
        yield gw


def test_a_cut_event_stream_ends_with_an_error_event_after_its_last_whole_event(
    messages_gateway: GatewayServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        _, answer = send_raw(messages_gateway.url, "POST", b"/v1/messages", b"{}", {"x-test-cut": "sse"})
    assert answer.status == 200 and answer.headers["content-type"].startswith("text/event-stream")
    first, error, done = answer.body.split(b"\n\n")[:3]
    assert first == b'data: {"n": 1}'
    assert orjson.loads(error.removeprefix(b"data: "))["error"]["code"] == "upstream_unavailable"
    assert done == b"data: [DONE]" and answer.body.endswith(b"\n\n") and b'{"par' not in answer.body
    assert_one_warning(caplog)


def test_a_cut_plain_body_is_a_clear_error_not_a_truncated_success(
    messages_gateway: GatewayServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        _, answer = send_raw(messages_gateway.url, "POST", b"/v1/messages", b"{}", {"x-test-cut": "json"})
    assert answer.status == 503
    error = orjson.loads(answer.body)["error"]
    assert (error["type"], error["code"]) == ("server_error", "upstream_unavailable")
    assert answer.headers["retry-after"]
    assert not [r for r in caplog.records if "already started" in r.getMessage() or r.exc_info]


def assert_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    gateway_records = [r for r in caplog.records if r.name.startswith("gateway")]
    assert [r.levelno for r in gateway_records] == [logging.WARNING], [r.getMessage() for r in gateway_records]
    assert "midway" in gateway_records[0].getMessage()
    assert not [r for r in caplog.records if "already started" in r.getMessage() or r.exc_info]
