"""The simulator's data parallelism is vLLM 0.32's: one server, ``data_parallel_size`` engines with their own
blocks, prefix caches and queues; ``X-data-parallel-rank`` pins a request, vLLM's balancer places the rest, and
every ``vllm:`` series carries its engine's label."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.engine.vllm_api.metrics import parse_metrics
from testing.vllm_sim import DataParallelSimulator, SimConfig, Simulator, create_sim_app
from testing.vllm_sim.dp import RankOutOfRange, load_score, requested_rank
from testing.vllm_sim.engine import Sequence

BLOCK = 4
COMPLETIONS = "/v1/completions"


def cluster(size: int = 2, **config: Any) -> DataParallelSimulator:
    """Engines the test steps itself."""
    dp = DataParallelSimulator(SimConfig(**{"max_model_len": 64, "num_blocks": 8, "block_size": BLOCK,
                                            "data_parallel_size": size, **config}))
    dp.paused = True
    return dp


def submit(dp: DataParallelSimulator, tokens: int, *, rank: int | None = None, n: int = 1,
           start: int = 1) -> list[Sequence]:
    return dp.submit(list(range(start, start + tokens)), n, 4, 4, lambda seq: None, rank=rank)


def families(page: bytes) -> dict[str, list[Any]]:
    return {f.name: f.samples for f in text_string_to_metric_families(page.decode())}


# -- the header ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("header", "size", "rank"), [
    (None, 2, None),
    ("0", 2, 0),
    ("1", 2, 1),
    (" 1 ", 2, 1),  # int() reads what vLLM's int() reads
    ("+1", 2, 1),
    ("one", 2, None),  # not an integer: vLLM balances it as if there were no header
    ("1.0", 2, None),
    ("", 2, None),
    ("0", 1, 0),
])
def test_a_rank_header_pins_the_rank_it_names_and_one_that_is_not_an_integer_is_ignored(
    header: str | None, size: int, rank: int | None
) -> None:
    assert requested_rank(header, size) == rank


@pytest.mark.parametrize(("header", "size", "message"), [
    ("2", 2, "data_parallel_rank 2 is out of range [0, 2)."),
    ("-1", 2, "data_parallel_rank -1 is out of range [0, 2)."),
    ("1", 1, "data_parallel_rank 1 is out of range [0, 1)."),
])
def test_a_rank_the_server_does_not_have_is_refused_in_vllms_words(header: str, size: int, message: str) -> None:
    with pytest.raises(RankOutOfRange) as raised:
        requested_rank(header, size)
    assert str(raised.value) == message


# -- the balancer ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("waiting", "running", "kv_usage", "score"), [
    (0, 0, 0.0, 0.0),
    (0, 3, 1.0, 3.0),  # nothing waits: KV pressure does not count
    (2, 1, 0.5, 3.0),  # waiting counts as running up to half the cache
    (2, 1, 0.75, 3.0 + 2 * 6 * 0.25),
    (1, 0, 1.0, 1.0 + 3.0),  # at a full cache each waiting request weighs four
])
def test_the_load_score_is_vllms_requests_plus_a_waiting_penalty_under_kv_pressure(
    waiting: int, running: int, kv_usage: float, score: float
) -> None:
    assert load_score(waiting, running, kv_usage) == pytest.approx(score)


def test_idle_engines_take_balanced_requests_in_turn() -> None:
    dp = cluster()
    dp.paused = False
    ranks = [submit(dp, 6, start=10 * i)[0].rank for i in range(5)]
    assert ranks == [0, 1, 0, 1, 0]  # each finished at once, so the rotating scan start decides
    assert [engine.prompt_tokens_total for engine in dp.ranks] == [18, 12]


def test_a_balanced_request_goes_to_the_engine_with_fewer_requests() -> None:
    dp = cluster()
    for i in range(3):
        submit(dp, 6, rank=0, start=10 * i)
    placed = [submit(dp, 6, start=100 + 10 * i)[0].rank for i in range(5)]
    # 3 against 0, 1, 2; then 3 against 3, a tie the rotating scan start gives to rank 1; then 3 against 4.
    assert placed == [1, 1, 1, 1, 0]
    assert [engine.waiting for engine in dp.ranks] == [4, 4]


@pytest.mark.parametrize(("big_prompt", "chosen"), [
    (28, 1),  # 7 of 8 blocks used: its waiting request weighs 1 + 6 x 0.375, so 4.25 against 3
    (8, 0),  # 2 of 8 blocks used: no penalty, 2 against 3
])
def test_a_waiting_request_on_a_full_engine_sends_the_next_one_elsewhere(big_prompt: int, chosen: int) -> None:
    dp = cluster()
    submit(dp, big_prompt, rank=0)
    for i in range(3):
        submit(dp, 2, rank=1, start=100 + 10 * i)
    dp.step()
    submit(dp, 2, rank=0, start=200)
    assert ([e.running for e in dp.ranks], [e.waiting for e in dp.ranks]) == ([1, 3], [1, 0])
    dp.scan_start = 0
    assert submit(dp, 2, start=300)[0].rank == chosen


@pytest.mark.parametrize(("rank", "ranks"), [
    (None, [0, 1]),  # vLLM fans the choices out into engine requests, each placed on its own
    (1, [1, 1]),
])
def test_the_choices_of_one_request_are_placed_one_by_one(rank: int | None, ranks: list[int]) -> None:
    dp = cluster()
    assert [seq.rank for seq in submit(dp, 6, rank=rank, n=2)] == ranks


def test_each_choice_is_one_sequence_with_its_own_target() -> None:
    dp = cluster()
    seqs = dp.submit(list(range(1, 7)), 2, 4, [3, 2], lambda seq: None)
    assert [(seq.index, seq.target) for seq in seqs] == [(0, 3), (1, 2)]


def test_an_aborted_request_leaves_every_engine_it_ran_on() -> None:
    dp = cluster()
    seqs = submit(dp, 6, n=2)
    dp.step()
    assert [engine.running for engine in dp.ranks] == [1, 1]
    dp.abort(seqs)
    assert [engine.running for engine in dp.ranks] == [0, 0]
    assert [engine.used_blocks for engine in dp.ranks] == [0, 0]
    assert dp.cancelled == 1


# -- one engine's blocks and cache -----------------------------------------------------------------------

def test_each_engine_holds_num_blocks_of_its_own() -> None:
    dp = cluster()
    submit(dp, 28, rank=0)
    submit(dp, 28, rank=1, start=100)
    dp.step()
    assert [engine.used_blocks for engine in dp.ranks] == [7, 7]  # 14 blocks in all: more than one engine has
    assert [engine.kv_cache_usage for engine in dp.ranks] == [7 / 8, 7 / 8]
    assert dp.capacity_tokens == 8 * BLOCK


@pytest.mark.parametrize(("second_rank", "hit_tokens"), [
    (0, 8),  # two of its three full blocks found (the last token is always computed)
    (1, 0),  # the other engine never saw the prompt
])
def test_a_prompt_is_cached_only_on_the_engine_that_ran_it(second_rank: int, hit_tokens: int) -> None:
    dp = cluster()
    dp.paused = False
    submit(dp, 12, rank=0)
    (seq,) = submit(dp, 12, rank=second_rank)
    assert seq.cached_tokens == hit_tokens
    assert [engine.prefix_cache_hits_total for engine in dp.ranks][second_rank] == hit_tokens


def test_one_engine_preempts_without_touching_the_other() -> None:
    dp = cluster()
    submit(dp, 14, rank=0)  # 4 blocks growing to 5
    submit(dp, 14, rank=0, start=100)
    submit(dp, 14, rank=1, start=200)
    for _ in range(8):
        dp.step()
    assert [engine.preemptions_total for engine in dp.ranks] == [1, 0]
    assert dp.preemptions_total == 1


# -- metrics ---------------------------------------------------------------------------------------------

def test_every_vllm_series_carries_each_engines_label() -> None:
    dp = cluster(size=3)
    submit(dp, 6, rank=2)
    dp.step()
    for name, samples in families(dp.metrics_text()).items():
        assert {s.labels["engine"] for s in samples} == {"0", "1", "2"}, name


def test_each_engine_publishes_its_own_cache_config_differing_only_by_engine() -> None:
    dp = cluster()
    info = [s.labels for s in families(dp.metrics_text())["vllm:cache_config_info"]]
    assert sorted(labels["engine"] for labels in info) == ["0", "1"]
    assert {**info[0], "engine": ""} == {**info[1], "engine": ""}
    # Each engine's 8 blocks and the null block, summed over the engines as vLLM's API server labels them; the
    # tokens are one engine's.
    assert info[0]["num_gpu_blocks"] == "18" and info[0]["kv_cache_size_tokens"] == str(9 * int(info[0]["block_size"]))


def test_the_gateways_parser_reads_each_engines_own_figures() -> None:
    dp = cluster()
    submit(dp, 28, rank=1)
    dp.step()
    submit(dp, 2, rank=1, start=100)
    page = parse_metrics(dp.metrics_text().decode())
    assert page.engines == 2
    assert {rank: (m.running, m.waiting, m.num_gpu_blocks) for rank, m in page.ranks.items()} == {
        "0": (0, 0, 9), "1": (1, 1, 9),
    }
    assert page.ranks["1"].kv_usage == pytest.approx(7 / 8) and page.ranks["0"].kv_usage == 0.0


API_SERVERS = ("vllm:admission_rejections",)  # families the API server labels by model and reason only


def test_one_engine_keeps_the_page_it_always_had() -> None:
    sim = create_sim_app(SimConfig(num_blocks=8, block_size=BLOCK)).state.sim
    assert type(sim) is Simulator
    page = families(sim.metrics_text())
    engines = {s.labels.get("engine") for name, samples in page.items() for s in samples
               if not name.startswith(API_SERVERS)}
    assert engines == {"0"}
    # The API server's own counters carry no engine label, in vLLM as here (vllm/v1/metrics/loggers.py).
    assert {s.labels.get("engine") for name, samples in page.items() if name.startswith(API_SERVERS)
            for s in samples} == {None}


# -- over HTTP -------------------------------------------------------------------------------------------

@pytest.fixture
async def client() -> AsyncIterator[tuple[httpx.AsyncClient, DataParallelSimulator]]:
    app = create_sim_app(SimConfig(max_model_len=64, num_blocks=8, block_size=BLOCK, data_parallel_size=2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as http:
        yield http, app.state.sim


def completion(stream: bool = False) -> dict[str, Any]:
    return {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "stream": stream}


@pytest.mark.parametrize(("header", "prompt_tokens"), [
    ({"X-data-parallel-rank": "1"}, [0, 10]),
    ({"x-data-parallel-rank": "0"}, [10, 0]),
    ({"X-data-parallel-rank": "first"}, [5, 5]),  # balanced: one each
    ({}, [5, 5]),
])
async def test_completions_run_on_the_rank_their_header_names(
    client: tuple[httpx.AsyncClient, DataParallelSimulator], header: dict[str, str], prompt_tokens: list[int]
) -> None:
    http, dp = client
    for _ in range(2):
        answer = await http.post(COMPLETIONS, json=completion(), headers=header)
        assert answer.status_code == 200
    assert [engine.prompt_tokens_total for engine in dp.ranks] == prompt_tokens
    assert list(dp.rank_headers_seen) == [next(iter(header.values()), None)] * 2


async def test_a_rank_out_of_range_is_a_400_without_a_param(
    client: tuple[httpx.AsyncClient, DataParallelSimulator]
) -> None:
    http, dp = client
    answer = await http.post(COMPLETIONS, json=completion(), headers={"X-data-parallel-rank": "2"})
    assert answer.status_code == 400
    assert answer.json() == {"error": {"message": "data_parallel_rank 2 is out of range [0, 2).",
                                       "type": "BadRequestError", "param": None, "code": 400}}
    assert dp.running + dp.waiting == 0 and [e.prompt_tokens_total for e in dp.ranks] == [0, 0]


async def test_a_streamed_rank_out_of_range_is_an_error_event_after_a_200(
    client: tuple[httpx.AsyncClient, DataParallelSimulator]
) -> None:
    http, _ = client
    answer = await http.post(COMPLETIONS, json=completion(stream=True), headers={"X-data-parallel-rank": "7"})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in answer.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert orjson.loads(events[0])["error"] == {"message": "data_parallel_rank 7 is out of range [0, 2).",
                                                 "type": "BadRequestError", "param": None, "code": 400}


async def test_one_engine_refuses_any_rank_but_zero() -> None:
    app = create_sim_app(SimConfig(max_model_len=64, num_blocks=8, block_size=BLOCK))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as http:
        statuses = [(await http.post(COMPLETIONS, json=completion(), headers={"X-data-parallel-rank": r})).status_code
                    for r in ("0", "1")]
    assert statuses == [200, 400]


async def test_the_metrics_page_counts_each_engines_requests(
    client: tuple[httpx.AsyncClient, DataParallelSimulator]
) -> None:
    http, _ = client
    for rank in ("1", "1", "0"):
        await http.post(COMPLETIONS, json=completion(), headers={"X-data-parallel-rank": rank})
    page = families((await http.get("/metrics")).content)
    finished = {s.labels["engine"]: s.value for s in page["vllm:request_success"]
                if s.name.endswith("_total") and s.labels["finished_reason"] == "length"}
    assert finished == {"0": 1.0, "1": 2.0}


@pytest.mark.parametrize(("path", "request_body", "tokens_on"), [
    (COMPLETIONS, {"prompt": "Hello there", "max_tokens": 2}, [False, True]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, [False, True]),
    # vLLM's Responses API never reads the header: balanced, the first request to rank 0.
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}, [True, False]),
])
async def test_the_generation_routes_that_read_the_header_pin_their_request(
    tokenizer: Any, path: str, request_body: dict[str, Any], tokens_on: list[bool]
) -> None:
    app = create_sim_app(SimConfig(tokenizer=tokenizer, max_model_len=256, num_blocks=32, block_size=16,
                                   data_parallel_size=2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim") as http:
        answer = await http.post(path, json={"model": "tiny", **request_body}, headers={"X-data-parallel-rank": "1"})
    assert answer.status_code == 200, answer.text
    assert [engine.prompt_tokens_total > 0 for engine in app.state.sim.ranks] == tokens_on
