"""Canonical paths and the route table: every form of a path is one route, or refused."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from pydantic import ValidationError

from gateway.cli import main, parse_serve
from gateway.config import GENERATING_ROUTES, Settings
from gateway.errors import MethodNotAllowed, NotFound
from gateway.http.errors import error_headers, status_and_type
from gateway.http.routes import GUARDED_ROUTES, MAX_PATH_BYTES, PUBLIC_ROUTES, RouteTable, canonical_path


def as_server_reads(target: str) -> tuple[bytes, str]:
    """ASGI's raw_path and path for a request target, as uvicorn fills them in (it unquotes the raw path)."""
    raw = target.encode("latin-1")
    return raw, unquote(target)


NORMALISED: list[tuple[str, str, str]] = [
    # id, as sent, canonical
    ("plain", "/v1/chat/completions", "/v1/chat/completions"),
    ("the root", "/", "/"),
    ("a dot segment after /v1", "/v1/./chat/completions", "/v1/chat/completions"),
    ("a dot segment inside the route", "/v1/chat/./completions", "/v1/chat/completions"),
    ("a dot segment in completions", "/v1/./completions", "/v1/completions"),
    ("a dot segment first", "/./v1/chat/completions", "/v1/chat/completions"),
    ("a segment and its dot-dot", "/v1/x/../chat/completions", "/v1/chat/completions"),
    ("two segments and two dot-dots", "/v1/a/b/../../chat/completions", "/v1/chat/completions"),
    ("dot-dot that stays inside the root", "/v1/../metrics", "/metrics"),
    ("a dot-dot last", "/v1/chat/completions/..", "/v1/chat"),
    ("a dot last", "/v1/chat/completions/.", "/v1/chat/completions"),
    ("a leading double slash", "//v1/chat/completions", "/v1/chat/completions"),
    ("repeated slashes inside", "/v1//chat///completions", "/v1/chat/completions"),
    ("a trailing slash", "/v1/chat/completions/", "/v1/chat/completions"),
    ("trailing slashes", "/v1/completions//", "/v1/completions"),
    ("a percent-encoded letter", "/v1/%63hat/completions", "/v1/chat/completions"),
    ("an encoded letter in upper case", "/v1/%43hat/completions", "/v1/Chat/completions"),
    ("three dots are a name", "/v1/.../chat", "/v1/.../chat"),
    ("a name starting with a dot", "/v1/.hidden", "/v1/.hidden"),
    ("a dot-dot suffix is a name", "/v1/chat..", "/v1/chat.."),
    ("a semicolon stays", "/v1/chat/completions;x=1", "/v1/chat/completions;x=1"),
    ("encoded UTF-8", "/v1/%C3%A9", "/v1/\u00e9"),
    ("a fullwidth dot is a name", "/v1/\uff0e\uff0e/metrics", "/v1/\uff0e\uff0e/metrics"),
    ("an invalid UTF-8 dot", "/v1/%C0%AE%C0%AE/metrics", "/v1/\ufffd\ufffd\ufffd\ufffd/metrics"),
    ("a space, encoded", "/v1/chat%20/completions", "/v1/chat /completions"),
    ("the longest path allowed", "/" + "a" * (MAX_PATH_BYTES - 1), "/" + "a" * (MAX_PATH_BYTES - 1)),
]


@pytest.mark.parametrize(("sent", "expected"), [c[1:] for c in NORMALISED], ids=[c[0] for c in NORMALISED])
def test_a_path_is_normalised_to_its_canonical_form(sent: str, expected: str) -> None:
    raw, path = as_server_reads(sent) if sent.isascii() else (sent.encode(), sent)
    assert canonical_path(raw, path) == expected


REFUSED: list[tuple[str, str]] = [
    ("an encoded dot segment", "/v1/%2e/chat/completions"),
    ("an encoded dot segment in upper case", "/v1/%2E/chat/completions"),
    ("an encoded dot-dot out of /v1", "/v1/%2e%2e/metrics"),
    ("an encoded dot-dot, mixed case", "/v1/%2E%2e/openapi.json"),
    ("half an encoded dot-dot", "/v1/.%2e/invocations"),
    ("the other half", "/v1/%2e./scale_elastic_ep"),
    ("an encoded dot in a name", "/v1/chat%2ecompletions"),
    ("an encoded slash", "/v1/chat%2fcompletions"),
    ("an encoded slash in upper case", "/v1%2Fchat%2Fcompletions"),
    ("an encoded backslash", "/v1/chat%5ccompletions"),
    ("an encoded backslash in upper case", "/v1%5Cchat/completions"),
    ("a backslash", "/v1\\chat\\completions"),
    ("a backslash dot-dot", "/v1/..\\metrics"),
    ("a double-encoded dot-dot", "/v1/%252e%252e/metrics"),
    ("a double-encoded slash", "/v1/chat%252fcompletions"),
    ("an encoded NUL", "/v1/chat/completions%00"),
    ("an encoded newline", "/v1/chat/completions%0a"),
    ("an encoded tab", "/v1/%09/chat/completions"),
    ("an encoded DEL", "/v1/chat%7f/completions"),
    ("dot-dot above the root", "/../v1/chat/completions"),
    ("dot-dot above the root from /v1", "/v1/../../metrics"),
    ("dot-dot alone", "/.."),
    ("dot-dot above the root, then back", "/v1/../../v1/chat/completions"),
    ("one byte over the length bound", "/" + "a" * MAX_PATH_BYTES),
    ("an overlong path of dot segments", "/v1" + "/." * 600 + "/chat/completions"),
    ("no leading slash", "v1/chat/completions"),
    ("an absolute URL", "http://upstream/v1/chat/completions"),
]


@pytest.mark.parametrize("sent", [c[1] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_an_ambiguous_or_hostile_path_is_refused_with_404(sent: str) -> None:
    raw, path = as_server_reads(sent)
    with pytest.raises(NotFound) as info:
        canonical_path(raw, path)
    assert status_and_type(info.value)[0] == 404 and info.value.code == "not_found"


CONTROL: list[tuple[str, str]] = [
    ("a NUL", "/v1/chat\x00/completions"),
    ("a newline", "/v1/chat/completions\n"),
    ("a carriage return", "/v1/\r/chat/completions"),
    ("a DEL", "/v1/\x7f/chat/completions"),
    ("an escape", "/v1/chat/completions\x1b"),
]


@pytest.mark.parametrize("path", [c[1] for c in CONTROL], ids=[c[0] for c in CONTROL])
def test_control_characters_are_refused_whatever_the_server_decoded(path: str) -> None:
    with pytest.raises(NotFound):
        canonical_path(path.encode(), path)
    with pytest.raises(NotFound):
        canonical_path(None, path)


def test_without_a_raw_path_the_decoded_path_is_normalised() -> None:
    assert canonical_path(None, "/v1/./chat//completions/") == "/v1/chat/completions"


def test_the_refusal_states_the_length_limit_and_the_length_given() -> None:
    with pytest.raises(NotFound) as info:
        canonical_path(None, "/" + "x" * 5000)
    assert f"5001 bytes long; the limit is {MAX_PATH_BYTES}" in info.value.message


# -- the route table ------------------------------------------------------------------------------
ROUTES: list[tuple[str, str, str, str]] = [
    # method, as sent, kind, name
    ("POST", "/v1/chat/completions", "guarded", "chat"),
    ("POST", "/v1/completions", "guarded", "completions"),
    ("POST", "/v1/responses", "guarded", "responses"),
    ("POST", "/v1/embeddings", "guarded", "embeddings"),
    ("POST", "/pooling", "guarded", "pooling"),
    ("POST", "/score", "guarded", "score"),
    ("POST", "/v1/score", "guarded", "score"),
    ("POST", "/rerank", "guarded", "rerank"),
    ("POST", "/v1/rerank", "guarded", "rerank"),
    ("POST", "/v2/rerank", "guarded", "rerank"),
    ("POST", "/classify", "guarded", "classify"),
    ("GET", "/v1/models", "gateway", "models"),
    ("GET", "/health", "gateway", "health"),
    ("GET", "/metrics", "gateway", "metrics"),
    ("GET", "/guard/status", "gateway", "status"),
    ("POST", "/guard/restart", "gateway", "restart"),
    ("POST", "/tokenize", "passthrough", "/tokenize"),
    ("POST", "/detokenize", "passthrough", "/detokenize"),
    ("GET", "/version", "passthrough", "/version"),
    ("POST", "/v1/./chat/completions", "guarded", "chat"),
    ("POST", "/v1/x/../completions/", "guarded", "completions"),
    ("POST", "//v1/responses", "guarded", "responses"),
    ("GET", "/v1/../metrics", "gateway", "metrics"),
    ("POST", "/v1/../tokenize", "passthrough", "/tokenize"),
]


@pytest.mark.parametrize(("method", "sent", "kind", "name"), ROUTES, ids=[f"{r[0]} {r[1]}" for r in ROUTES])
def test_every_route_resolves_to_its_kind_and_canonical_path(method: str, sent: str, kind: str, name: str) -> None:
    raw, path = as_server_reads(sent)
    route = RouteTable().resolve(method, raw, path)
    assert (route.kind, route.name) == (kind, name)
    assert route.path == canonical_path(raw, path)


def test_every_guarded_route_is_post_only_and_says_so() -> None:
    table = RouteTable()
    for path in GUARDED_ROUTES:
        with pytest.raises(MethodNotAllowed) as info:
            table.resolve("GET", path.encode(), path)
        assert status_and_type(info.value)[0] == 405 and info.value.allowed == "POST"


def test_a_known_path_with_another_method_is_405_with_allow() -> None:
    with pytest.raises(MethodNotAllowed) as info:
        RouteTable().resolve("POST", b"/version", "/version")
    assert error_headers(info.value) == {"allow": "GET"}
    assert info.value.message == "Method POST is not allowed on /version; use GET."


UNKNOWN = [
    "/v1/no-such-thing", "/openapi.json", "/docs", "/scale_elastic_ep", "/sleep", "/collective_rpc",
    "/v1/load_lora_adapter", "/v1/chat/completions/batch", "/cohere/v2/chat", "/generative_scoring",
    "/v1/systemone", "/v2/embed", "/v1/realtime", "/v1/responses/resp_1", "/V1/chat/completions", "/",
    "/v1", "/v1/chat", "/v1/chat/completions/render", "/ping", "/load", "/server_info", "/pause",
]


@pytest.mark.parametrize("path", UNKNOWN)
def test_a_path_outside_the_table_is_404(path: str) -> None:
    with pytest.raises(NotFound):
        RouteTable().resolve("POST", path.encode(), path)


@pytest.mark.parametrize("path", GENERATING_ROUTES)
def test_a_generating_route_is_404_until_named_and_then_passes_through(path: str) -> None:
    with pytest.raises(NotFound) as info:
        RouteTable().resolve("POST", path.encode(), path)
    assert f"--passthrough-route {path}" in info.value.message
    route = RouteTable([path]).resolve("POST", path.encode(), path)
    assert (route.kind, route.path) == ("passthrough", path)


def test_naming_one_generating_route_opens_only_that_one() -> None:
    table = RouteTable(["/v1/messages"])
    with pytest.raises(NotFound):
        table.resolve("POST", b"/invocations", "/invocations")


def test_the_table_refuses_a_route_that_is_not_a_known_generating_one() -> None:
    with pytest.raises(ValueError, match="not a vLLM generating route"):
        RouteTable(["/scale_elastic_ep"])


def test_no_route_is_both_guarded_and_passed_through() -> None:
    assert not set(GUARDED_ROUTES) & set(PUBLIC_ROUTES)
    assert not set(GUARDED_ROUTES) & set(GENERATING_ROUTES)


# -- the flag ---------------------------------------------------------------------------------------
def test_the_flag_is_repeatable_and_defaults_to_nothing() -> None:
    assert Settings().passthrough_route == []
    settings = parse_serve(["serve", "--passthrough-route", "/v1/messages", "--passthrough-route", "/invocations"], {})
    assert settings.passthrough_route == ["/v1/messages", "/invocations"]


def test_the_flag_comes_from_the_environment_too() -> None:
    settings = parse_serve(["serve"], {"VLLM_GUARD_PASSTHROUGH_ROUTE": "/v1/messages,/v1/audio/transcriptions"})
    assert settings.passthrough_route == ["/v1/messages", "/v1/audio/transcriptions"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/metrics", "/v1/./messages", "v1/messages", ""])
def test_the_flag_refuses_anything_but_a_known_generating_route(path: str) -> None:
    with pytest.raises(ValidationError, match="not a vLLM generating route"):
        Settings(passthrough_route=[path])


def test_a_bad_flag_stops_start_up_with_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--passthrough-route", "/scale_elastic_ep"]) == 2
    err = capsys.readouterr().err
    assert "--passthrough-route" in err and "/scale_elastic_ep" in err and "/v1/messages" in err
