"""The live page in a real browser: headless Chromium against a gateway in front of the simulator, with
requests in flight and queued. The page must show the values ``/guard/status`` shows; a screenshot is saved.

Chromium is Debian's ``chromium`` package (scripts/install-chromium.sh, run by scripts/test.sh); where it is not
installed the tests say so and skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed here (scripts/install-chromium.sh installs Debian's chromium): "
    "the live page's browser test is skipped",
)

ADMIN = "admin-key-for-the-page"
BLOCK_SIZE = 16
# Each request books ceil((prompt + 120) / 16) = 9 or 10 blocks: three fit in the 32-block budget, the rest queue.
MAX_TOKENS = 120
REQUESTS = 6
IN_FLIGHT = 3
SHOWN = ("capacity-blocks", "budget-blocks", "committed-blocks", "in-flight", "queued", "upstream-state",
         "limit-max-model-len", "limit-policy", "updated")


class ById(HTMLParser):
    """The text inside each element that has an id, and the attributes of <body>."""

    def __init__(self) -> None:
        super().__init__()
        self.text: dict[str, str] = {}
        self.body: dict[str, str | None] = {}
        self._open: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "body":
            self.body = found
        if tag in ("meta", "input", "br", "link"):
            return
        element_id = found.get("id")
        self._open.append((tag, element_id))
        if element_id:
            self.text[element_id] = ""

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            open_tag, _ = self._open.pop()
            if open_tag == tag:
                break

    def handle_data(self, data: str) -> None:
        for _, element_id in self._open:
            if element_id:
                self.text[element_id] += data


def parse(dom: str) -> ById:
    page = ById()
    page.feed(dom)
    return page


def number(shown: str) -> int:
    return int(shown.replace(",", "").strip())


async def chromium(profile: Path, url: str, *args: str) -> str:
    """Run headless Chromium on ``url``: virtual time lets the page poll a few times without real waiting."""
    assert CHROMIUM is not None
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--no-default-browser-check", f"--user-data-dir={profile}", "--hide-scrollbars",
        "--virtual-time-budget=3000", *args, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 90)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


@pytest.fixture
def sim(tokenizer: Any, tokenizer_dir: Any) -> Iterator[SimServer]:
    # Slow tokens: the admitted requests hold their blocks for the whole test, so what is shown stays still.
    config = SimConfig(
        model="tiny", root=str(tokenizer_dir), max_model_len=512, num_blocks=32, block_size=BLOCK_SIZE,
        tokenizer=tokenizer, token_delay=0.5,
    )
    with run_sim_server(config) as server:
        yield server


@pytest.fixture
def gateway(sim: SimServer, base_settings: Settings) -> Iterator[GatewayServer]:
    with run_gateway(
        base_settings, upstream=sim.url, admin_api_key=[ADMIN], admission_policy="strict", queue_timeout=120.0,
        read_timeout=120.0,
    ) as gw:
        yield gw


def get(gw: GatewayServer, path: str) -> dict[str, Any]:
    r = httpx.get(gw.url + path, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


async def until(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def queued_requests(gw: GatewayServer) -> AsyncIterator[None]:
    """Streams that fill the KV budget and a queue behind them; cancelled (and released) on exit."""

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", gw.url + "/v1/chat/completions", json=body,
                                 headers={"x-guard-priority": str(i % 2)}) as r:
            async for _ in r.aiter_bytes():
                pass

    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.create_task(one(client, i)) for i in range(REQUESTS)]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_page_shows_live_values_that_match_the_status(gateway: GatewayServer, tmp_path: Path) -> None:
    async with queued_requests(gateway):
        def settled() -> bool:
            s = get(gateway, "/guard/status")
            return bool(s["in_flight"] == IN_FLIGHT and s["queued"] == REQUESTS - IN_FLIGHT)

        await until(settled, "three requests in flight and three queued")
        # The page shows the sampler's latest second: wait until it has seen the queue.
        def sampled() -> bool:
            samples = get(gateway, "/guard/ui/data")["samples"]
            return bool(samples and samples[-1]["queued"] == REQUESTS - IN_FLIGHT)

        await until(sampled, "a sample of the queue")
        status = get(gateway, "/guard/status")
        dom = await chromium(tmp_path / "profile", f"{gateway.url}/guard/ui#key={ADMIN}&window=60", "--dump-dom")
        screenshot = tmp_path / "guard-ui.png"
        await chromium(tmp_path / "profile", f"{gateway.url}/guard/ui#key={ADMIN}&window=60",
                       f"--screenshot={screenshot}", "--window-size=1280,1400")
        after = get(gateway, "/guard/status")

    page = parse(dom)
    assert page.body.get("data-state") == "live", page.text.get("offline-message")
    shown = {k: page.text.get(k, "").strip() for k in SHOWN}
    assert number(shown["capacity-blocks"]) == status["capacity_blocks"] == 32
    assert number(shown["budget-blocks"]) == status["budget_blocks"] == 32
    assert number(shown["committed-blocks"]) == status["committed_blocks"] == after["committed_blocks"]
    assert status["committed_blocks"] in (IN_FLIGHT * 9, IN_FLIGHT * 10)
    assert number(shown["in-flight"]) == status["in_flight"] == IN_FLIGHT
    assert number(shown["queued"]) == status["queued"] == REQUESTS - IN_FLIGHT
    assert shown["upstream-state"] == status["upstream"]["state"] == "ready"
    assert number(shown["limit-max-model-len"]) == status["upstream"]["max_model_len"] == 512
    assert shown["limit-policy"] == "strict"
    by_priority = sorted(status["queued_by_priority"].items(), key=lambda kv: -int(kv[0]))
    assert page.text["queued-by-priority"].strip() == ", ".join(f"prio {p}: {n}" for p, n in by_priority)
    assert ADMIN not in dom  # the key is taken out of the address and never written into the page

    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 20_000  # a rendered page, not a blank one
    await until(lambda: get(gateway, "/guard/status")["committed_blocks"] == 0, "the cancelled requests' release")
    final = get(gateway, "/guard/status")
    assert (final["in_flight"], final["queued"]) == (0, 0)


async def test_without_the_key_the_page_asks_for_it(gateway: GatewayServer, tmp_path: Path) -> None:
    dom = await chromium(tmp_path / "profile", f"{gateway.url}/guard/ui", "--dump-dom")
    page = parse(dom)
    assert page.body.get("data-state") == "need-key"
    assert "admin key" in page.text["key-message"]
    assert page.text["capacity-blocks"].strip() == "—"
