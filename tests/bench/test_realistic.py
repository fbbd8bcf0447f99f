"""The realistic benchmark's pure parts: its traffic, a run's figures, the ratios and the report's rows."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import statistics
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bench.benchmarks.realistic import ENGINE_OF, TARGETS, GatewaySpec, gateway_specs, measures, variant
from bench.benchmarks.realistic_run import LOADS, quick_loads
from bench.harness import plots
from bench.harness.cpu import Spinner, cpu_seconds
from bench.workloads.realistic import (
    MAX_TOKENS,
    MIXES,
    WORDS,
    Outcome,
    Planned,
    capacity,
    figures,
    length_body,
    lognormal_length,
    plan,
    prompt,
)
from bench.workloads.realistic_clients import run_aiohttp
from gateway.tools.tinymodel import build_tokenizer
from testing.vllm_sim import SimConfig, run_sim_server
from testing.vllm_sim.engine import stop_chance


def test_arrivals_are_poisson_at_the_rate_and_repeat_per_seed() -> None:
    planned = plan(4.0, 500.0, seed=7)
    assert planned == plan(4.0, 500.0, seed=7) and planned != plan(4.0, 500.0, seed=8)
    assert len(planned) / 500.0 == pytest.approx(4.0, rel=0.05)
    gaps = [b.at - a.at for a, b in itertools.pairwise(planned)]
    # Exponential gaps: their standard deviation equals their mean.
    assert statistics.pstdev(gaps) == pytest.approx(statistics.fmean(gaps), rel=0.1)
    assert all(0 < p.at < 500.0 for p in planned)
    assert all(150 <= p.words <= 400 for p in planned)


def test_lengths_are_lognormal_around_200_and_within_max_tokens() -> None:
    rng = random.Random(1)
    lengths = [lognormal_length(rng) for _ in range(20_000)]
    assert statistics.fmean(lengths) == pytest.approx(200, rel=0.04)
    assert statistics.median(lengths) == pytest.approx(200 * math.exp(-0.32), rel=0.04)
    assert min(lengths) >= 1 and max(lengths) <= MAX_TOKENS


def test_every_target_gets_the_same_sizes_in_words_of_its_own() -> None:
    planned = Planned(0.0, 200, 50)
    texts = [prompt(planned, 3, seed=1, target=t) for t in range(4)]
    assert all(len(t.split()) == 200 for t in texts)
    assert len(set(texts)) == 4
    assert texts[0] == prompt(planned, 3, seed=1, target=0)
    # The first 128-token block of two targets' prompts differs: no prefix-cache hit across targets.
    assert len({t.split()[:40].__repr__() for t in texts}) == 4


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_the_words_leave_room_for_the_answer_in_the_tiny_models_context(tmp_path: Path, mix: str) -> None:
    tok = AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path)))
    longest = prompt(Planned(0.0, MIXES[mix].max_words, 1), 0, seed=0, target=0)
    assert all(len(tok.encode(" " + w, add_special_tokens=False)) <= 2 for w in WORDS)
    assert len(tok.encode(longest, add_special_tokens=False)) + MIXES[mix].max_tokens + 32 <= 2048


def test_the_long_mix_draws_longer_prompts_and_shorter_answers_than_the_chat_mix() -> None:
    chat, long = plan(4.0, 300.0, seed=3), plan(4.0, 300.0, seed=3, mix=MIXES["long"])
    assert len(long) == pytest.approx(len(chat), rel=0.1)  # the same rate
    assert all(500 <= p.words <= 850 and p.max_tokens == 512 and 1 <= p.length <= 512 for p in long)
    assert all(p.max_tokens == MAX_TOKENS for p in chat)
    assert statistics.fmean(p.words for p in long) > 2 * statistics.fmean(p.words for p in chat)
    assert statistics.fmean(p.length for p in long) == pytest.approx(60, rel=0.15)
    assert statistics.fmean(p.length for p in long) < statistics.fmean(p.length for p in chat) / 2


@pytest.mark.parametrize(("load", "factor"), [("overload-1.5x", 1.5), ("overload", 2.0), ("overload-3x", 3.0)])
def test_the_grids_overloads_differ_only_in_their_rate(load: str, factor: float) -> None:
    assert (LOADS[load].rate_factor, LOADS[load].duration_s, LOADS[load].read_timeout_s) == (factor, 60.0, 30.0)
    assert LOADS[load].sustained and not LOADS["capacity"].sustained
    assert quick_loads()[load].duration_s == 12.0 and quick_loads()["capacity"].duration_s == 8.0


@pytest.mark.parametrize(("length", "bias"), [(1, 100.0), (30, 2.694), (200, 0.376), (400, -1.151), (600, -100.0)])
def test_the_length_body_biases_eos_alone_so_that_a_token_ends_the_answer_with_the_chance_one_in_l(
    length: int, bias: float
) -> None:
    body = length_body(length, 2)
    assert body == {"logit_bias": {"2": bias}}  # no min_tokens: nothing the gateway reads
    if length <= 400:  # the tiny model's chance per token, as measured on vLLM's CPU build
        assert 1 / stop_chance(bias) == pytest.approx(length, rel=0.01)


def outcome(at: float, ttft: float | None, tokens: int = 100, status: int | None = 200, end: float = 10.0,
            timed_out: bool = False) -> Outcome:
    return Outcome(at, status, ttft, tokens, end, timed_out)


def test_figures_count_goodput_refusals_and_timeouts() -> None:
    outcomes = [
        outcome(0.0, 1.0), outcome(1.0, 3.0), outcome(2.0, 7.0, end=20.0),  # 20 s wall; the last is too late
        outcome(3.0, None, 0, 503), outcome(4.0, None, 0, 429),
        outcome(5.0, None, 0, None, timed_out=True),
        outcome(6.0, None, 0, 500),
    ]
    fig = figures(outcomes, objective=5.0, preemptions=3, cpu=(26.0, 6.0, 4.0))
    assert fig.tokens_per_s == pytest.approx(300 / 20)
    assert fig.mean_ttft == pytest.approx(11 / 3)
    assert fig.p99_ttft == 7.0
    assert fig.goodput == pytest.approx(2 / 20)
    assert (fig.completed, fig.within, fig.refused, fig.timeouts, fig.failed) == (3, 2, 2, 1, 1)
    assert fig.preemptions == 3
    assert fig.refusal_p99_ms == pytest.approx(7000)  # the slower refusal answered 7 s after it was sent
    assert (fig.engine_cpu_s, fig.gateway_cpu_s, fig.client_cpu_s) == (26.0, 6.0, 4.0)
    assert fig.cores_busy == pytest.approx(36 / 20)  # engine, gateway and client together over the wall time


def test_a_runs_figures_become_the_harness_figures_of_its_load() -> None:
    fig = figures([outcome(0.0, 1.0), outcome(1.0, 7.0, end=20.0)], objective=5.0, cpu=(10.0, 2.0, 1.0))
    got = fig.as_dict("double_")
    assert got["double_tokens_per_s"] == pytest.approx(200 / 20) and got["double_within_pct"] == 50.0
    assert got["double_gateway_cpu_us_token"] == pytest.approx(2.0 * 1e6 / 200)
    assert got["double_cores_busy"] == pytest.approx(13 / 20)
    keys = {m.key for m in measures(["double"], split=False, waits=[])}
    assert {k for k in got if k in keys} == set(got)  # every figure is a measure of the table


def test_a_variant_names_a_commit_or_this_tree_its_flags_and_how_its_threads_run() -> None:
    assert variant("b4=abc123::--preemption-budget=4,--shed-early=off") == (
        "b4", GatewaySpec("abc123", ("--preemption-budget=4", "--shed-early=off")))
    assert variant("tree=.") == ("tree", GatewaySpec(None, ()))
    assert variant("n10=.@nice=10") == ("n10", GatewaySpec(None, (), "nice=10"))
    assert variant("b=abc::--x=1@batch") == ("b", GatewaySpec("abc", ("--x=1",), "batch"))
    for wrong in ("no-name", "x=.@fast"):
        with pytest.raises(SystemExit, match="NAME=COMMIT"):
            variant(wrong)


def test_the_gateway_targets_run_their_policy_at_their_commit() -> None:
    args = argparse.Namespace(gateway_commit=None, baseline_commit="HEAD~3", variant=["b4=.::--preemption-budget=4"],
                              objective=5.0)
    specs = gateway_specs(args, ["direct", "strict", "default", "objective", "default+watermark", "baseline"])
    assert specs == {"strict": GatewaySpec(None, ("--admission-policy", "strict")), "default": GatewaySpec(None, ()),
                     "objective": GatewaySpec(None, ("--ttft-objective", "5")),
                     "default+watermark": GatewaySpec(None, ("--engine-watermark", "0.05")),
                     "baseline": GatewaySpec("HEAD~3", ()), "b4": GatewaySpec(None, ("--preemption-budget=4",))}


def test_the_gateway_beside_the_watermark_fronts_the_watermarks_engine_and_is_told_of_it() -> None:
    assert ENGINE_OF["default+watermark"] == ENGINE_OF["watermark"] == "watermark"
    assert "default+watermark" in TARGETS and ENGINE_OF.get("default", "direct") == "direct"


def test_capacity_is_the_highest_rate_under_the_bound_below_which_all_were() -> None:
    assert capacity({0.5: 0.3, 1.0: 0.6, 2.0: 0.9, 3.0: 1.4, 4.0: 0.8}) == 2.0
    assert capacity({1.0: 1.2}) is None


async def test_the_client_sends_the_plan_and_reads_what_came_back() -> None:
    # The simulator draws each answer's length from the bias on its stand-in EOS (id 2) as the tiny model would.
    async with run_sim_server(SimConfig(max_model_len=4096, num_blocks=512, block_size=16)) as server:
        planned = [Planned(0.0, 20, 7), Planned(0.01, 30, 1), Planned(0.02, 10, 40)]
        texts = [prompt(p, i, 0, 0) for i, p in enumerate(planned)]
        outcomes = await run_aiohttp(server.url, planned, texts, eos_id=2, read_timeout=30.0)
        seen = list(server.sim.requests_seen)
        drawn = [server.sim.output_length(i, MAX_TOKENS, False, 0, length_body(p.length, 2)["logit_bias"]["2"])
                 for i, p in enumerate(planned)]
    assert sorted(o.tokens for o in outcomes) == sorted(drawn) and drawn[1] == 1
    assert all(o.completed and o.ttft is not None and o.end >= o.at for o in outcomes)
    assert all(body["max_tokens"] == MAX_TOKENS and "min_tokens" not in body for body in seen)


def test_the_ttft_picture_is_a_png(tmp_path: Path) -> None:
    if plots.unavailable():
        pytest.skip(plots.unavailable() or "")
    series = [plots.TtftSeries("direct", [0.0, 1.0], [0.2, 6.0], timed_out=[2.0]),
              plots.TtftSeries("default", [0.0, 1.0], [0.2, 0.4], refused=[2.0])]
    path = plots.ttft_figure(tmp_path / "t.png", "t", series, objective=5.0, timeout=30.0)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_vllms_client_results_become_outcomes() -> None:
    from bench.workloads.realistic_clients import _vllm_outcome

    result = {"errors": ["", "Service Unavailable (503)", "TimeoutError: read timeout"], "start_times": [5.0, 6.0, 7.0],
              "latencies": [2.0, 0.01, 30.0], "ttfts": [0.3, 0.0, 0.0], "output_lens": [120, 0, 0]}
    planned = [Planned(0.0, 200, 120), Planned(1.0, 200, 9), Planned(2.0, 200, 9)]
    done, refused, timed_out = (_vllm_outcome(p, result, i, 5.0) for i, p in enumerate(planned))
    assert done == Outcome(0.0, 200, 0.3, 120, 2.0) and done.completed
    assert refused.status == 503 and not refused.completed
    assert timed_out.timed_out and timed_out.end == pytest.approx(2.0 + 2.0 + 30.0)


def test_the_busy_targets_spinner_is_valid_python_at_any_share() -> None:
    for share in (0.0, 0.3, 1.0, 2.0):
        compile(Spinner(share).code, "<busy>", "exec")
    assert "busy" in TARGETS


def test_the_grids_cpu_hog_spins_in_a_session_of_its_own_and_says_what_it_took() -> None:
    with Spinner(1.0, session=True) as hog:
        proc = hog._proc
        assert proc is not None
        assert os.getsid(proc.pid) == proc.pid != os.getsid(0)
        deadline = time.monotonic() + 10
        while cpu_seconds(proc.pid) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert hog.cpu_s >= 0.05 and proc.poll() is not None
