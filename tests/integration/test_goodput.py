"""The default policy against the vLLM simulator when answers stop far short of max_tokens (each request draws a
lognormal length, as production chat does): having learned the lengths, it runs several times the batch strict
does, and lets the engine preempt far less than the same flood sent straight to it; strict preempts never."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from testing.gateway_thread import GatewayServer
from testing.vllm_sim import SimServer, lognormal_lengths
from tests.integration import test_admission_flood as flood_rig
from tests.integration.test_admission_flood import STRICT_BUDGET, PeakInFlight, completion, flood

exits, make_sim, make_gateway = flood_rig.exits, flood_rig.make_sim, flood_rig.make_gateway

PROMPT, MAX_TOKENS = 16, 96  # 7 blocks of 16 booked at the worst case: strict runs 4 at once in its 28
LEARN, BURST = 24, 40


def sim_with_short_answers(make_sim: Callable[..., SimServer]) -> SimServer:
    return make_sim(stop_early=lognormal_lengths(12, 0.8, seed=5))


def body() -> dict[str, Any]:
    return completion(PROMPT, MAX_TOKENS, stream=True)


async def burst_through(gw: GatewayServer) -> int:
    """Learn the lengths, then send the burst; returns the most requests the gateway ran at once in it."""
    learned = await flood(gw.url, LEARN, body())
    assert [r.status_code for r in learned] == [200] * LEARN
    sampler = PeakInFlight(gw)
    responses = await flood(gw.url, BURST, body())
    peak = sampler.stop()
    assert [r.status_code for r in responses] == [200] * BURST
    return peak


async def test_the_default_policy_runs_a_larger_batch_than_strict_and_preempts_far_less_than_the_bare_engine(
    make_sim: Callable[..., SimServer], make_gateway: Callable[..., GatewayServer]
) -> None:
    direct = sim_with_short_answers(make_sim)
    for n in (LEARN, BURST):
        assert all(r.status_code == 200 for r in await flood(direct.url, n, body()))
    peaks, preempted = {}, {}
    for policy in ("strict", "adaptive"):
        sim = sim_with_short_answers(make_sim)
        gw = make_gateway(sim, admission_policy=policy, queue_timeout=30.0)
        peaks[policy] = await burst_through(gw)
        preempted[policy] = sim.sim.preemptions_total
    assert preempted["strict"] == 0 and peaks["strict"] <= STRICT_BUDGET // 7
    assert peaks["adaptive"] >= 2 * peaks["strict"], peaks
    assert direct.sim.preemptions_total > 0
    assert preempted["adaptive"] <= direct.sim.preemptions_total / 4, (preempted, direct.sim.preemptions_total)
