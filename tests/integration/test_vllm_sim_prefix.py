"""The vLLM simulator caches prefixes as vLLM 0.32's V1 KV cache manager does: shared blocks are held once,
freed blocks stay findable until evicted tail first, the last prompt token is always computed, salts and
LoRA adapters key blocks apart, and the hits show in vLLM's counters and usage details."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testing.vllm_sim import SimConfig, Simulator, create_sim_app
from testing.vllm_sim.blocks import BlockPool
from testing.vllm_sim.engine import Sequence

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BLOCK = 16
PREFIX = list(range(1000, 1048))  # three full blocks


def ids(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def engine(**config: Any) -> Simulator:
    """A simulator the test steps itself."""
    sim = Simulator(SimConfig(**{"max_model_len": 256, "num_blocks": 32, "block_size": BLOCK, **config}))
    sim.paused = True
    return sim


def submit(sim: Simulator, prompt: list[int], max_tokens: int, n: int = 1, **keys: Any) -> list[Sequence]:
    return sim.submit(prompt, n, max_tokens, max_tokens, lambda seq: None, **keys)


def run_to_completion(sim: Simulator, seqs: list[Sequence]) -> None:
    for _ in range(10_000):
        if all(s.done for s in seqs):
            return
        sim.step()
    raise AssertionError("the engine did not finish")


def make_client(**config: Any) -> tuple[httpx.AsyncClient, Simulator]:
    app = create_sim_app(SimConfig(**{"max_model_len": 256, "num_blocks": 64, "block_size": BLOCK, **config}))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim"), app.state.sim


def samples(page: str) -> dict[str, Any]:
    return {s.name: s for family in text_string_to_metric_families(page) for s in family.samples}


def sse_events(text: str) -> list[Any]:
    return [orjson.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


# -- sharing while running -------------------------------------------------------------------------------

@pytest.mark.parametrize(("caching", "held"), [
    (True, 3 + 2 * 1),  # the three prefix blocks once, and each request's own fourth block
    (False, 2 * 4),
])
def test_running_requests_hold_a_shared_prefix_once_only_with_prefix_caching(caching: bool, held: int) -> None:
    sim = engine(prefix_caching=caching)
    submit(sim, PREFIX + ids(1, 8), 4)
    submit(sim, PREFIX + ids(9, 8), 4)
    sim.step()
    assert sim.running == 2
    assert sim.used_blocks == held
    assert sim.kv_cache_usage == pytest.approx(held / 32)


@pytest.mark.parametrize(("caching", "held", "cached_tokens"), [
    (True, 2 + 3 * 1, [0, 32, 32]),  # the siblings hit the first choice's two full prompt blocks
    (False, 3 * 3, [0, 0, 0]),
])
def test_the_choices_of_one_request_share_prompt_blocks_through_the_cache(
    caching: bool, held: int, cached_tokens: list[int]
) -> None:
    sim = engine(prefix_caching=caching)
    seqs = submit(sim, ids(1, 40), 8, n=3)
    sim.step()
    assert sim.used_blocks == held
    assert [s.cached_tokens for s in seqs] == cached_tokens
    run_to_completion(sim, seqs)
    assert sim.used_blocks == 0


# -- what stays cached -----------------------------------------------------------------------------------

def test_a_finished_requests_blocks_stay_cached_and_a_later_request_hits_them() -> None:
    sim = engine()
    run_to_completion(sim, submit(sim, PREFIX + ids(1, 8), 2))
    assert (sim.used_blocks, sim.cached_blocks, sim.free_blocks) == (0, 3, 32)
    later = submit(sim, PREFIX + ids(9, 8), 2)[0]
    computed = sim.step()
    assert later.cached_tokens == 48
    assert computed == 56 - 48
    # The three hits left the free queue for the request; one block more holds its tail.
    assert (sim.used_blocks, sim.free_blocks) == (4, 28)
    assert (sim.prefix_cache_queries_total, sim.prefix_cache_hits_total) == (56 + 56, 48)


@pytest.mark.parametrize(("prompt_tokens", "hit"), [
    (16, 0),  # its only full block holds the last token
    (17, 16),
    (32, 16),  # the second block holds the last token: recomputed, though cached
    (33, 32),
])
def test_a_repeated_prompt_hits_its_full_blocks_but_never_its_last_token(prompt_tokens: int, hit: int) -> None:
    sim = engine()
    prompt = ids(100, prompt_tokens)
    run_to_completion(sim, submit(sim, prompt, 1))
    again = submit(sim, prompt, 1)[0]
    assert sim.step() == prompt_tokens - hit
    assert again.cached_tokens == hit


def test_eviction_takes_the_least_recently_freed_blocks_tail_first() -> None:
    sim = engine(num_blocks=8)
    first = ids(100, 64)  # four full blocks
    run_to_completion(sim, submit(sim, first, 1))
    assert sim.cached_blocks == 4
    # Six blocks of a new prompt: the four never used, then two of the cached ones, the tail ones first.
    run_to_completion(sim, submit(sim, ids(500, 96), 1))
    again = submit(sim, first, 1)[0]
    sim.step()
    assert again.cached_tokens == 32


def test_the_request_freed_first_is_evicted_first() -> None:
    sim = engine(num_blocks=8)
    older, newer = ids(100, 32), ids(200, 32)
    run_to_completion(sim, submit(sim, older, 1))
    run_to_completion(sim, submit(sim, newer, 1))
    run_to_completion(sim, submit(sim, ids(500, 96), 1))  # four unused blocks, then both of the older's
    # Looked up newer first: the older's lookup would take free blocks and so evict the newer's.
    hits = [submit(sim, prompt, 1)[0] for prompt in (newer, older)]
    sim.step()
    assert [s.cached_tokens for s in hits] == [16, 0]


def test_a_preempted_sequence_resumes_from_its_own_cached_blocks() -> None:
    sim = engine(num_blocks=6)
    short = submit(sim, ids(100, 16), 18)[0]  # at most 3 blocks
    long = submit(sim, ids(200, 40), 20)[0]  # at most 4: together more than the 6
    while sim.preemptions_total == 0:
        sim.step()
    assert short.finish_reason == "length"
    assert not long.running and long.generated == 17
    # 40 + 17 tokens to recompute; the three full blocks it left cached are still there.
    assert sim.step() == 57 - 48
    assert long.running
    run_to_completion(sim, [long])
    # vLLM's counters count a request's first lookup only.
    assert (sim.prefix_cache_queries_total, sim.prefix_cache_hits_total) == (16 + 40, 0)


class ListPool:
    """vLLM's free queue written the obvious way: one list, blocks named 0..n-1, keys by block."""

    def __init__(self, blocks: int) -> None:
        self.queue, self.refs = list(range(blocks)), dict[int, int]()
        self.key_of, self.holders = dict[int, int](), dict[int, list[int]]()

    def lookup(self, keys: list[int]) -> list[int]:
        hits: list[int] = []
        for key in keys:
            if key not in self.holders:
                break
            hits.append(self.holders[key][0])
        return hits

    def take(self, hits: list[int], count: int) -> list[int]:
        for block in hits:
            if block not in self.refs:
                self.queue.remove(block)
            self.refs[block] = self.refs.get(block, 0) + 1
        new = [self.queue.pop(0) for _ in range(count)]
        for block in new:
            if block in self.key_of:
                key = self.key_of.pop(block)
                self.holders[key].remove(block)
                if not self.holders[key]:
                    del self.holders[key]
            self.refs[block] = 1
        return hits + new

    def cache(self, blocks: list[int], keys: list[int], start: int, end: int) -> None:
        for block, key in zip(blocks[start:end], keys[start:end], strict=True):
            if block not in self.key_of:
                self.key_of[block] = key
                self.holders.setdefault(key, []).append(block)

    def release(self, blocks: list[int]) -> None:
        uncached: list[int] = []
        cached: list[int] = []
        for block in reversed(blocks):
            self.refs[block] -= 1
            if not self.refs[block]:
                del self.refs[block]
                (cached if block in self.key_of else uncached).append(block)
        self.queue = uncached + self.queue + cached


@pytest.mark.parametrize("seed", range(20))
def test_the_block_pool_hands_out_hits_and_evicts_as_one_free_queue_would(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.randint(4, 40)
    pool, model = BlockPool(size, caching=True), ListPool(size)
    held: list[list[int]] = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            blocks = held.pop(rng.randrange(len(held)))
            pool.release(blocks)
            model.release(blocks)
        else:
            keys = [rng.randint(0, 12) for _ in range(rng.randint(1, 5))]  # few keys: many hits and duplicates
            hits = pool.lookup(keys)
            assert hits == model.lookup(keys)
            if len(keys) - len(hits) + pool.evictable(hits) > pool.free:
                continue
            pool.touch(hits)
            blocks = hits + pool.take(len(keys) - len(hits))
            assert blocks == model.take(hits, len(keys) - len(hits))
            full = rng.randint(len(hits), len(keys))
            pool.cache(blocks, keys, len(hits), full)
            model.cache(blocks, keys, len(hits), full)
            held.append(blocks)
        assert (pool.free, pool.used, pool.cached_blocks) == (len(model.queue), len(model.refs), len(model.key_of))


# -- what keys a block -----------------------------------------------------------------------------------

SQL = ("sql", "/adapters/sql")


@pytest.mark.parametrize(("first", "second", "hit"), [
    ({}, {}, 32),
    ({"cache_salt": "alice"}, {"cache_salt": "alice"}, 32),
    ({"cache_salt": "alice"}, {"cache_salt": "bob"}, 0),
    ({}, {"cache_salt": "bob"}, 0),
    ({"lora": SQL}, {"lora": SQL}, 32),
    ({"lora": SQL}, {}, 0),
    ({"lora": SQL}, {"lora": ("sql", "/adapters/sql-v2")}, 0),  # a name re-pointed at another adapter
])
def test_salts_and_lora_adapters_key_blocks_apart(first: dict[str, Any], second: dict[str, Any], hit: int) -> None:
    sim = engine()
    run_to_completion(sim, submit(sim, ids(1, 40), 1, **first))
    later = submit(sim, ids(1, 40), 1, **second)[0]
    sim.step()
    assert later.cached_tokens == hit


@pytest.mark.parametrize(("first", "second", "cached"), [
    ({"cache_salt": "alice"}, {"cache_salt": "alice"}, 32),
    ({"cache_salt": "alice"}, {"cache_salt": "bob"}, 0),
    ({"model": "sql"}, {"model": "sql"}, 32),
    ({"model": "sql"}, {"model": "tiny"}, 0),
])
async def test_the_request_body_carries_salt_and_adapter_to_the_cache(
    first: dict[str, Any], second: dict[str, Any], cached: int
) -> None:
    client, _ = make_client(lora_modules={"sql": "/adapters/sql"}, enable_prompt_tokens_details=True)
    async with client:
        for extra in (first, second):
            r = await client.post(COMPLETIONS, json={"prompt": ids(1, 40), "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


@pytest.mark.parametrize(("salt", "message"), [
    ("", "Parameter 'cache_salt' must be a non-empty string if provided."),
    ("a/b", "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/'"),
    ("x" * 129, "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/'"),
])
async def test_a_bad_cache_salt_is_refused_like_vllm(salt: str, message: str) -> None:
    client, sim = make_client()
    async with client:
        r = await client.post(COMPLETIONS, json={"prompt": "hi", "cache_salt": salt})
    assert r.status_code == 400
    error = r.json()["error"]
    assert message in error["message"]
    assert (error["type"], error["param"]) == ("Bad Request", "cache_salt")
    assert sim.prefix_cache_queries_total == 0


async def test_lora_adapters_are_listed_and_answer_under_their_name() -> None:
    client, _ = make_client(lora_modules={"sql": "/adapters/sql"})
    async with client:
        cards = (await client.get("/v1/models")).json()["data"]
        body = (await client.post(COMPLETIONS, json={"prompt": "hi", "model": "sql", "max_tokens": 1})).json()
    assert [(c["id"], c["root"], c["parent"], c["max_model_len"]) for c in cards] == [
        ("tiny", "tiny", None, 256), ("sql", "/adapters/sql", "tiny", None)]
    assert body["model"] == "sql"


# -- what responses and metrics report --------------------------------------------------------------------

ChatDetails = Callable[[int], dict[str, Any]]


@pytest.mark.parametrize(("path", "stream", "details"), [
    (CHAT, False, lambda hit: {"cached_tokens": hit, "created_cache_tokens": 0, "multimodal_tokens": None}),
    (CHAT, True, lambda hit: {"cached_tokens": hit, "created_cache_tokens": 0}),
    (COMPLETIONS, False, lambda hit: {"cached_tokens": hit, "created_cache_tokens": None, "multimodal_tokens": None}),
    (COMPLETIONS, True, lambda hit: {"cached_tokens": hit}),
])
async def test_usage_reports_cached_tokens_with_prompt_tokens_details(
    path: str, stream: bool, details: ChatDetails
) -> None:
    client, sim = make_client(enable_prompt_tokens_details=True)
    body: dict[str, Any] = {"max_tokens": 2, "stream": stream}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "word " * 60}]
    else:
        body["prompt"] = ids(1, 40)
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with client:
        for _ in range(2):
            r = await client.post(path, json=body)
    usage = sse_events(r.text)[-1]["usage"] if stream else r.json()["usage"]
    hit = (usage["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert hit > 0
    assert usage["prompt_tokens_details"] == details(hit)
    assert sim._task is None  # both answered without the scheduler loop: the synchronous path caches too


@pytest.mark.parametrize("stream", [False, True])
async def test_without_prompt_tokens_details_usage_has_none(stream: bool) -> None:
    client, _ = make_client()
    body = {"prompt": ids(1, 40), "max_tokens": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with client:
        for _ in range(2):
            r = await client.post(COMPLETIONS, json=body)
    usage = sse_events(r.text)[-1]["usage"] if stream else r.json()["usage"]
    assert usage.get("prompt_tokens_details") is None


@pytest.mark.parametrize(("stream", "cached"), [
    (False, 32),  # the choice that finished last: a sibling that hit the first choice's blocks
    (True, 0),  # the choice whose output came first: the one that found nothing cached
])
async def test_several_choices_report_the_sequence_vllm_reports(stream: bool, cached: int) -> None:
    client, _ = make_client(enable_prompt_tokens_details=True)
    body = {"prompt": ids(1, 40), "max_tokens": 2, "n": 3, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with client:
        r = await client.post(COMPLETIONS, json=body)
    usage = sse_events(r.text)[-1]["usage"] if stream else r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == cached


async def test_the_responses_api_reports_cached_input_tokens() -> None:
    client, _ = make_client()
    body = {"input": "word " * 60, "max_output_tokens": 2}
    async with client:
        first = (await client.post("/v1/responses", json=body)).json()["usage"]
        second = (await client.post("/v1/responses", json=body)).json()["usage"]
    hit = (second["input_tokens"] - 1) // BLOCK * BLOCK
    assert first["input_tokens_details"]["cached_tokens"] == 0
    assert first["input_tokens_details"]["cache_write_tokens"] == second["input_tokens"] // BLOCK * BLOCK
    assert second["input_tokens_details"]["cached_tokens"] == hit > 0


@pytest.mark.parametrize(("caching", "queries", "hits", "label"), [
    (True, 40 + 40, 32, "True"),
    (False, 0, 0, "False"),
])
async def test_prefix_cache_counters_and_the_caching_label_are_vllms(
    caching: bool, queries: int, hits: int, label: str
) -> None:
    client, _ = make_client(prefix_caching=caching)
    async with client:
        for _ in range(2):
            await client.post(COMPLETIONS, json={"prompt": ids(1, 40), "max_tokens": 2})
        page = samples((await client.get("/metrics")).text)
    assert page["vllm:prefix_cache_queries_total"].value == queries
    assert page["vllm:prefix_cache_hits_total"].value == hits
    assert page["vllm:prefix_cache_hits_total"].labels == {"model_name": "tiny", "engine": "0"}
    assert page["vllm:cache_config_info"].labels["enable_prefix_caching"] == label
    assert page["vllm:kv_cache_usage_perc"].value == 0  # cached but free blocks count as free
