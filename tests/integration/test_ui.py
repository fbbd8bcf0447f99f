"""The live page: the page itself, its data route, and who may read them, over HTTP in front of the simulator."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from gateway.errors import InvalidRequest
from gateway.http import ui
from gateway.observe.history import History
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server
from tests.support.paths import ROOT

ADMIN, CLIENT = "admin-key-0123", "client-key-4567"


@pytest.fixture
def sim(tokenizer: Any, tokenizer_dir: Any) -> Iterator[SimServer]:
    config = SimConfig(
        model="tiny", root=str(tokenizer_dir), max_model_len=512, num_blocks=64, block_size=16, tokenizer=tokenizer
    )
    with run_sim_server(config) as server:
        yield server


@pytest.fixture
def gateway(sim: SimServer, base_settings: Settings) -> Iterator[GatewayServer]:
    with run_gateway(base_settings, upstream=sim.url) as gw:
        yield gw


def sample_now(gw: GatewayServer) -> dict[str, Any]:
    """Take a sample on the gateway's loop now rather than waiting for the next second."""

    async def take() -> dict[str, Any]:
        assert gw.parts.sampler is not None
        return gw.parts.sampler.sample()

    result: dict[str, Any] = gw.call(take)
    return result


# -- the page file ----------------------------------------------------------------------------------
def test_the_page_is_one_file_that_fetches_nothing_from_elsewhere() -> None:
    html = ui.load_page().decode()
    assert "<canvas" in html and "<script>" in html and "<style>" in html
    assert re.search(r"https?://", html) is None
    assert re.search(r"<(?:script|link|img|iframe)[^>]+(?:src|href)=", html) is None
    for element_id in ("capacity-blocks", "committed-blocks", "live-used-blocks", "in-flight", "queued"):
        assert f'id="{element_id}"' in html


def test_the_page_ships_as_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "static/*.html" in config["tool"]["setuptools"]["package-data"]["gateway.http"]


# -- parsing and limits ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "expected"),
    [pytest.param(None, None, id="absent"), pytest.param("", None, id="empty"), pytest.param("0", 0, id="zero"),
     pytest.param("42", 42, id="an-id")],
)
def test_since_reads_a_sample_id(raw: str | None, expected: int | None) -> None:
    assert ui.since(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [pytest.param("-1", id="negative"), pytest.param("abc", id="words"), pytest.param("1e3", id="exponent"),
     pytest.param("1.5", id="fraction"), pytest.param("9" * 19, id="too-long"),
     pytest.param("\uff11\uff12", id="non-ascii-digits")],
)
def test_since_refuses_anything_but_a_whole_number(raw: str) -> None:
    with pytest.raises(InvalidRequest, match="since must be a sample id") as caught:
        ui.since(raw)
    assert caught.value.param == "since"


def test_the_limits_are_the_settings_the_upstream_and_the_latest_kv_sample() -> None:
    settings = Settings(max_model_len=1024, kv_target=0.8, admission_policy="strict", max_queue=12,
                        queue_timeout=7.0, max_concurrency=4, on_prompt_overflow="truncate")
    history = History()
    history.add({"kv": {"capacity": 100, "budget": 80, "block_size": 16}})
    upstream = {"model": "tiny", "url": "http://127.0.0.1:8000", "effective_max_model_len": 1024,
                "max_model_len": 2048}
    limits = ui.limits(settings, upstream, history)
    assert limits == {
        "model": "tiny", "upstream_url": "http://127.0.0.1:8000", "max_model_len": 1024,
        "upstream_max_model_len": 2048, "max_prompt_tokens": None, "max_output_tokens": None,
        "on_prompt_overflow": "truncate", "on_max_tokens_overflow": "clamp", "block_size": 16,
        "capacity_blocks": 100, "budget_blocks": 80, "kv_target": 0.8, "admission_policy": "strict",
        "max_queue": 12, "queue_timeout_s": 7.0, "max_concurrency": 4, "managed": False,
    }


# -- over HTTP ---------------------------------------------------------------------------------------
def test_the_page_is_served_with_a_policy_that_keeps_it_to_its_own_origin(gateway: GatewayServer) -> None:
    r = httpx.get(gateway.url + "/guard/ui")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert r.content == ui.load_page()


def test_the_data_shows_the_history_and_the_limits(gateway: GatewayServer) -> None:
    first = sample_now(gateway)
    status = httpx.get(gateway.url + "/guard/status").json()
    second = sample_now(gateway)
    r = httpx.get(gateway.url + "/guard/ui/data")
    assert r.status_code == 200
    assert r.headers["cache-control"] == "no-store"
    body = r.json()
    assert body["last_id"] == second["id"] == first["id"] + 1
    assert [s["id"] for s in body["samples"]][-2:] == [first["id"], second["id"]]
    latest = body["samples"][-1]
    assert latest["kv"]["capacity"] == status["capacity_blocks"] == 64
    assert latest["kv"]["committed"] == status["committed_blocks"] == 0
    assert latest["upstream"]["state"] == status["upstream"]["state"] == "ready"
    assert body["limits"]["max_model_len"] == 512
    assert body["limits"]["budget_blocks"] == 64
    assert body["limits"]["block_size"] == 16
    assert body["events"][0]["state"] == "ready"
    assert body["sampler_ms"] is not None and body["sampler_ms"] >= 0


def test_the_data_after_an_id_holds_only_newer_samples(gateway: GatewayServer) -> None:
    first = sample_now(gateway)
    second = sample_now(gateway)
    body = httpx.get(gateway.url + "/guard/ui/data", params={"since": first["id"]}).json()
    assert [s["id"] for s in body["samples"]] == [second["id"]]
    assert httpx.get(gateway.url + "/guard/ui/data", params={"since": second["id"]}).json()["samples"] == []


def test_a_bad_since_is_an_openai_shaped_400(gateway: GatewayServer) -> None:
    r = httpx.get(gateway.url + "/guard/ui/data", params={"since": "yesterday"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "since")
    assert "yesterday" in error["message"]


@pytest.mark.parametrize(("method", "path"), [("POST", "/guard/ui"), ("DELETE", "/guard/ui/data")])
def test_the_page_routes_take_only_get(gateway: GatewayServer, method: str, path: str) -> None:
    r = httpx.request(method, gateway.url + path)
    assert r.status_code == 405
    assert r.headers["allow"] == "GET"


AUTH_CASES = [
    # (client keys, admin keys, key presented, status of the data route)
    pytest.param([], [], None, 200, id="no-keys-open"),
    pytest.param([CLIENT], [], None, 401, id="client-keys-need-a-key"),
    pytest.param([CLIENT], [], CLIENT, 200, id="client-keys-take-a-client-key"),
    pytest.param([], [ADMIN], None, 401, id="admin-key-needed-when-set"),
    pytest.param([], [ADMIN], ADMIN, 200, id="admin-key-taken"),
    pytest.param([CLIENT], [ADMIN], CLIENT, 401, id="a-client-key-is-not-enough-once-an-admin-key-is-set"),
    pytest.param([CLIENT], [ADMIN], ADMIN, 200, id="both-take-the-admin-key"),
    pytest.param([], [ADMIN], "wrong-key-0000", 401, id="a-wrong-key-is-refused"),
]


@pytest.mark.parametrize(("client_keys", "admin_keys", "presented", "expected"), AUTH_CASES)
def test_the_data_takes_the_admin_key_when_one_is_set_else_the_client_rule(
    sim: SimServer, base_settings: Settings, client_keys: list[str], admin_keys: list[str], presented: str | None,
    expected: int,
) -> None:
    headers = {"authorization": f"Bearer {presented}"} if presented else {}
    with run_gateway(base_settings, upstream=sim.url, api_key=client_keys, admin_api_key=admin_keys) as gw:
        data = httpx.get(gw.url + "/guard/ui/data", headers=headers)
        assert data.status_code == expected
        if expected == 401:
            assert data.json()["error"]["code"] == "invalid_api_key"
            assert ADMIN not in data.text and CLIENT not in data.text
        # The page holds no data and asks for the key itself: a browser cannot send one when it loads a page.
        assert httpx.get(gw.url + "/guard/ui").status_code == 200
