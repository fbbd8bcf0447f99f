"""An Admission in front of a scripted engine, on a fake clock and an injectable sleep: the admission tests' rig."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.admission import Admission, Reservation
from gateway.config import Settings
from gateway.engine.live import EngineView
from gateway.metrics import Metrics
from tests.support.clock import FakeClock, ManualSleep

BS = 16


def vllm_text(
    kv_usage: float, preemptions: float = 0.0, blocks: int = 100, block_size: int = BS, *,
    prefix_caching: bool | None = None, running: int | None = None, waiting: int = 0,
) -> str:
    """An engine whose requests can hold ``blocks`` blocks: vLLM reports one more, its null block."""
    caching = "" if prefix_caching is None else f',enable_prefix_caching="{prefix_caching}"'
    text = (
        f'vllm:kv_cache_usage_perc{{engine="0"}} {kv_usage}\n'
        f'vllm:num_preemptions_total{{engine="0"}} {preemptions}\n'
        f'vllm:cache_config_info{{block_size="{block_size}"{caching},engine="0",num_gpu_blocks="{blocks + 1}"}} 1.0\n'
    )
    if running is not None:
        text += f'vllm:num_requests_running{{engine="0"}} {running}\n'
        text += f'vllm:num_requests_waiting{{engine="0"}} {waiting}\n'
    return text


class Upstream:
    def __init__(self) -> None:
        self.text = ""
        self.down = False

    async def __call__(self, path: str) -> tuple[int, bytes]:
        if self.down:
            raise ConnectionRefusedError("refused")
        if path == "/metrics":
            return 200, self.text.encode()
        return 200, b'{"data":[{"id":"m","max_model_len":4096}]}'


class Rig:
    """An Admission in front of a scripted engine, on a fake clock."""

    def __init__(self, *, engine: bool = False, **flags: Any) -> None:
        flags.setdefault("queue_timeout", 30.0)  # the waits of these tests: a queue timeout of 30 s
        flags.setdefault("kv_target", 1.0)
        if not engine:
            flags.setdefault("kv_blocks", 10)
            flags.setdefault("block_size", BS)
        self.settings = Settings(**flags)
        self.clock = FakeClock()
        self.sleep = ManualSleep()
        self.metrics = Metrics()
        self.upstream = Upstream()
        self.view: EngineView | None = None
        if engine:
            self.view = EngineView(self.upstream, interval=0.25, stale_after=2.0, metrics=self.metrics,
                                   clock=self.clock, sleep=self.sleep)
        self.adm = Admission(self.settings, self.view, self.metrics, self.clock, sleep=self.sleep)
        self._ids = 0

    def req(self, blocks: int, priority: int = 0, *, prompt: int = 8, n: int = 1) -> Reservation:
        """A request needing exactly ``blocks`` blocks (n=1) with an ``prompt``-token prompt."""
        self._ids += 1
        return self.adm.reservation(prompt_tokens=prompt, max_tokens=blocks * BS - prompt, n=n,
                                    priority=priority, request_id=f"r{self._ids}")

    async def scrape(
        self, kv_usage: float, preemptions: float = 0.0, blocks: int = 100, *,
        prefix_caching: bool | None = None, running: int | None = None, waiting: int = 0,
    ) -> None:
        assert self.view is not None
        self.upstream.text = vllm_text(
            kv_usage, preemptions, blocks, prefix_caching=prefix_caching, running=running, waiting=waiting
        )
        await self.view.refresh()

    def count(self, name: str, **labels: str) -> float:
        """A sample as ``/metrics`` shows it: the admission's gauges are published as it is read."""
        self.adm.publish()
        return self.sample(name, **labels)

    def sample(self, name: str, **labels: str) -> float:
        """A sample as the registry holds it now, nothing published first."""
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def assert_drained(self) -> None:
        assert (self.adm.committed, self.adm.in_flight, self.adm.queued) == (0, 0, 0)


async def settle() -> None:
    """Let every ready task run until all wait again (no time passes)."""
    for _ in range(10):
        await asyncio.sleep(0)


def enter(r: Reservation) -> asyncio.Task[Reservation]:
    return asyncio.create_task(r.__aenter__())


async def release_all(rig: Rig, reservations: list[Reservation], tasks: list[asyncio.Task[Reservation]]) -> None:
    for r in reservations:
        r.release()
    for t in tasks:
        if not t.done():
            t.cancel()
        await asyncio.gather(t, return_exceptions=True)
    rig.assert_drained()


async def adaptive_rig_with_short_outputs(policy: str = "adaptive") -> tuple[Rig, list[Reservation]]:
    """100 blocks; past requests stopped after 8 tokens though allowed 152; 10 such requests fill the
    ledger, each seen running (prompt + 8 tokens = 1 block) by a snapshot showing 10 blocks in use."""
    rig = Rig(engine=True, admission_policy=policy)
    await rig.scrape(0.0)
    for _ in range(8):
        async with rig.req(10) as done:
            done.observe_output_tokens(8)
    running = [await rig.req(10).__aenter__() for _ in range(10)]
    rig.clock.now += 0.1
    for r in running:
        r.observe_output_tokens(8)
    rig.clock.now += 0.1
    await rig.scrape(0.10)
    return rig, running


async def five_running_after_slow_first_tokens(rig: Rig, seconds: float) -> list[Reservation]:
    """Ten requests admitted, each with its first token ``seconds`` after its admission, then five of them ended at
    five a second (0.2 s apart): the five still running."""
    running = [await rig.req(1).__aenter__() for _ in range(10)]
    rig.clock.now += seconds
    for r in running:
        r.observe_output_tokens(1)
    for r in running[:5]:
        rig.clock.now += 0.2
        r.release()
    return running[5:]
