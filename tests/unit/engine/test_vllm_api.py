"""Every vLLM version family's /metrics, /v1/models and /version (tests/fixtures/vllm/) read by the one parser of
each surface."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import orjson
import pytest

from gateway.engine.vllm_api import (
    EngineMetrics,
    ServedModel,
    parse_metrics,
    parse_models,
    parse_version,
    upstream_error_from,
)
from gateway.engine.vllm_api.errors import QUEUE_FULL_RETRY_AFTER
from gateway.errors import BadUpstreamResponse, EngineQueueFull, UpstreamError
from tests.support.paths import FIXTURES as ALL_FIXTURES

FIXTURES = ALL_FIXTURES / "vllm"

TINY = ServedModel("tiny", "/models/tiny", 2048)
NO_METRICS = {key: value for key, value in asdict(EngineMetrics()).items() if key != "ranks"}
# What each family's page must yield, over what a page without vLLM series yields.
PAGES: dict[str, dict[str, Any]] = {
    "v0-0.8.5": {
        "has_metrics": True, "kv_usage": 0.5, "running": 2, "waiting": 0, "preemptions_total": 0.0,
        "prompt_tokens_total": 4100.0, "generation_tokens_total": 2050.0, "request_success_total": 12.0,
        "block_size": 16, "num_gpu_blocks": 2000, "prefix_caching": False, "engines": 1,
    },
    "v1-0.10.2": {
        # Both usage spellings and both prefix-cache spellings are published: each is read once.
        "has_metrics": True, "kv_usage": 0.25, "running": 3, "waiting": 1, "preemptions_total": 9.0,
        "prompt_tokens_total": 12345.0, "generation_tokens_total": 6789.0, "request_success_total": 46.0,
        "prefix_cache_queries_total": 5200.0, "prefix_cache_hits_total": 1280.0,
        "block_size": 16, "num_gpu_blocks": 27000, "prefix_caching": True, "engines": 1,
    },
    "v1-0.32.0": {
        "has_metrics": True, "kv_usage": 0.25, "running": 3, "waiting": 1, "preemptions_total": 9.0,
        "prompt_tokens_total": 12345.0, "generation_tokens_total": 6789.0, "request_success_total": 46.0,
        "prefix_cache_queries_total": 5200.0, "prefix_cache_hits_total": 1280.0,
        "block_size": 128, "num_gpu_blocks": 32, "kv_cache_size_tokens": 4096, "prefix_caching": True, "engines": 1,
    },
    "v1-0.32.0-dp2": {
        # Counts summed over the two engines, the fuller engine's usage; blocks as vLLM labels every engine (the
        # engines' sum), tokens one engine's (each rank's own blocks: ``ranks``).
        "has_metrics": True, "kv_usage": 0.7, "running": 7, "waiting": 2, "preemptions_total": 3.0,
        "prompt_tokens_total": 4000.0, "generation_tokens_total": 1200.0, "request_success_total": 12.0,
        "prefix_cache_queries_total": 10400.0, "prefix_cache_hits_total": 2560.0,
        "block_size": 128, "num_gpu_blocks": 64, "kv_cache_size_tokens": 4096, "prefix_caching": True, "engines": 2,
    },
    "v1-0.32.0-disable-log-stats": {},
    "v1-0.33.0": {
        "has_metrics": True, "kv_usage": 0.95, "running": 1, "waiting": 4,
        "waiting_by_reason": {"capacity": 3, "deferred": 1}, "preemptions_total": 22.0,
        "prompt_tokens_total": 30000.0, "generation_tokens_total": 800.0, "request_success_total": 24.0,
        "prefix_cache_queries_total": 5200.0, "prefix_cache_hits_total": 1280.0, "admission_rejections_total": 9.0,
        "admission_rejections": {"max_num_queued_reqs": 7.0, "max_num_queued_tokens": 2.0},
        "block_size": 128, "num_gpu_blocks": 32, "kv_cache_size_tokens": 4096, "prefix_caching": True, "engines": 1,
    },
}
LISTINGS: dict[str, tuple[ServedModel, ...]] = {
    "v0-0.8.5": (TINY,),
    "v1-0.10.2": (ServedModel("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", 8192),),
    "v1-0.32.0": (TINY,),
    "v1-0.32.0-dp2": (TINY,),
    "v1-0.32.0-disable-log-stats": (TINY,),
    "v1-0.33.0": (TINY, ServedModel("tiny-chat", "/models/tiny", 2048),
                  ServedModel("tiny-sql", "/adapters/sql", None, parent="tiny")),
}
RELEASES = {
    "v0-0.8.5": (0, 8, 5), "v1-0.10.2": (0, 10, 2), "v1-0.32.0": (0, 32, 0), "v1-0.32.0-dp2": (0, 32, 0),
    "v1-0.32.0-disable-log-stats": (0, 32, 0), "v1-0.33.0": (0, 33, 0),
}


def family(name: str, surface: str) -> bytes:
    return (FIXTURES / name / surface).read_bytes()


def test_every_family_has_its_expectations() -> None:
    folders = {p.name for p in FIXTURES.iterdir() if p.is_dir()}
    assert folders == set(PAGES) == set(LISTINGS) == set(RELEASES)


@pytest.mark.parametrize("name", sorted(PAGES))
def test_each_family_metrics_page_reads_into_one_record(name: str) -> None:
    page = asdict(parse_metrics(family(name, "metrics.txt").decode()))
    del page["ranks"]
    assert page == {**NO_METRICS, **PAGES[name]}


def test_each_data_parallel_engine_keeps_its_own_figures() -> None:
    page = parse_metrics(family("v1-0.32.0-dp2", "metrics.txt").decode())
    assert {rank: asdict(r) for rank, r in page.ranks.items()} == {
        "0": {"kv_usage": 0.1, "running": 2, "waiting": 0, "preemptions_total": 1.0,
              "generation_tokens_total": 500.0, "num_gpu_blocks": 32},
        "1": {"kv_usage": 0.7, "running": 5, "waiting": 2, "preemptions_total": 2.0,
              "generation_tokens_total": 700.0, "num_gpu_blocks": 32},
    }


@pytest.mark.parametrize("name", sorted(set(PAGES) - {"v1-0.32.0-dp2"}))
def test_a_single_engines_rank_is_the_whole_page_and_unlabelled_series_have_none(name: str) -> None:
    page = parse_metrics(family(name, "metrics.txt").decode())
    expected = {"0"} if page.has_metrics and name.startswith("v1") else set()
    assert set(page.ranks) == expected
    for rank in page.ranks.values():
        assert (rank.kv_usage, rank.running, rank.waiting, rank.preemptions_total, rank.num_gpu_blocks) == (
            page.kv_usage, page.running, page.waiting, page.preemptions_total, page.num_gpu_blocks
        )


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_capacity_in_tokens_is_one_engines_cache(name: str) -> None:
    page = parse_metrics(family(name, "metrics.txt").decode())
    expected = {"v0-0.8.5": 32000, "v1-0.10.2": 432000}.get(name, 4096 if page.engines else None)
    assert page.capacity_tokens == expected


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_watchdogs_progress_comes_from_the_same_record(name: str) -> None:
    page = parse_metrics(family(name, "metrics.txt").decode())
    expected = PAGES[name]
    running = expected.get("running")
    assert page.progress == (
        None if running is None else float(running), expected.get("generation_tokens_total"),
        expected.get("preemptions_total"),
    )


@pytest.mark.parametrize("name", sorted(LISTINGS))
def test_each_family_model_listing_reads_into_one_record(name: str) -> None:
    listing = parse_models(family(name, "models.json"))
    assert listing.models == LISTINGS[name]
    base = LISTINGS[name][0]
    assert (listing.ids[0], listing.root, listing.max_model_len, listing.first) == (
        base.id, base.root, base.max_model_len, base
    )


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_each_family_version_reads_into_a_comparable_release(name: str) -> None:
    version = parse_version(family(name, "version.json"))
    assert version is not None and version.release == RELEASES[name]
    assert (version.release < (0, 10)) == name.startswith("v0-")


@pytest.mark.parametrize(
    ("body", "release", "text"),
    [
        (b'{"version": "0.10.2.dev123+g1234abcd.cpu"}', (0, 10, 2), "0.10.2.dev123+g1234abcd.cpu"),
        (b'{"version": "0.32.0+cpu"}', (0, 32, 0), "0.32.0+cpu"),
        (b'{"version": "0.9.0rc1"}', (0, 9, 0), "0.9.0rc1"),
        (b'{"version": "dev"}', (), "dev"),
        (b"<html>", None, None),
        (b'["0.32.0"]', None, None),
        (b'{"version": ""}', None, None),
        (b"{}", None, None),
    ],
)
def test_a_version_compares_by_its_release(body: bytes, release: tuple[int, ...] | None, text: str | None) -> None:
    version = parse_version(body)
    if release is None:
        assert version is None
    else:
        assert version is not None and (version.release, version.text, str(version)) == (release, text, text)


def test_versions_order_by_release_alone() -> None:
    old, dev, new = (parse_version(f'{{"version": "{v}"}}'.encode()) for v in ("0.9.2", "0.10.0.dev1", "0.10.0"))
    assert old is not None and dev is not None and new is not None
    assert old < dev == new


# Error bodies of each family, and of what may stand in front of vLLM: (status, body, type, code, param).
ERRORS: list[tuple[str, int, bytes, str, str | None, str | None]] = [
    ("0.10.1+ nested", 400, b'{"error": {"message": "This model\'s maximum context length is 2048 tokens. However, '
     b'your prompt contains at least 2049 input tokens", "type": "BadRequestError", "param": "input_tokens", '
     b'"code": 400}}', "invalid_request_error", "context_length_exceeded", "input_tokens"),
    ("0.8 flat", 400, b'{"object": "error", "message": "max_tokens must be at least 1", "type": '
     b'"BadRequestError", "param": null, "code": 400}', "invalid_request_error", None, None),
    ("0.8 flat 404", 404, b'{"object": "error", "message": "The model `x` does not exist.", "type": '
     b'"NotFoundError", "param": null, "code": 404}', "invalid_request_error", "model_not_found", None),
    ("FastAPI detail", 405, b'{"detail": "Method Not Allowed"}', "invalid_request_error", None, None),
    ("proxy HTML", 502, b"<html><head><title>502 Bad Gateway</title></head></html>", "server_error", None, None),
    ("queue full 0.29+", 503, b'{"error": {"message": "queue full", "type": "ServiceUnavailableError", '
     b'"param": null, "code": 503}}', "server_error", None, None),
]


@pytest.mark.parametrize(("case", "status", "body", "etype", "code", "param"), ERRORS, ids=[e[0] for e in ERRORS])
def test_each_error_shape_reads_into_an_openai_error(
    case: str, status: int, body: bytes, etype: str, code: str | None, param: str | None
) -> None:
    err = upstream_error_from(status, body, {"Retry-After": "3"})
    assert isinstance(err, UpstreamError) and err.message
    assert (err.status, err.type, err.code, err.param, err.upstream_retry_after) == (status, etype, code, param, "3")
    assert "<" not in err.message


def test_an_answer_that_is_no_error_is_a_bad_upstream_response() -> None:
    assert isinstance(upstream_error_from(302, b""), BadUpstreamResponse)


# vLLM 0.32's queue-cap answers, as vllm/entrypoints/serve/exception_handling/error_response.py words them.
QUEUE_CAP_ANSWERS = [
    ("max_num_queued_reqs", "The engine is currently busy and cannot accept new requests. Please try again later or "
     "on a different instance."),
    ("max_num_queued_tokens", "The engine has reached its prefill token backlog limit. Please try again later or on "
     "a different instance."),
]


@pytest.mark.parametrize(("reason", "message"), QUEUE_CAP_ANSWERS, ids=[a[0] for a in QUEUE_CAP_ANSWERS])
def test_vllms_queue_cap_503_becomes_the_gateways_own_refusal_with_a_retry_after(reason: str, message: str) -> None:
    body = orjson.dumps({"error": {"message": message, "type": "Service Unavailable", "param": None, "code": 503}})
    err = upstream_error_from(503, body)
    assert isinstance(err, EngineQueueFull)
    assert (err.status, err.type, err.code) == (503, "server_error", "engine_queue_full")
    assert err.reason == "engine_queue_full"
    assert err.retry_after == QUEUE_FULL_RETRY_AFTER and err.message == message


def test_a_queue_cap_503_keeps_a_retry_after_the_engine_sent() -> None:
    body = orjson.dumps({"error": {"message": QUEUE_CAP_ANSWERS[0][1], "type": "Service Unavailable", "code": 503}})
    err = upstream_error_from(503, body, {"retry-after": "4"})
    assert isinstance(err, EngineQueueFull) and err.retry_after == 4.0


def test_another_503_is_relayed_as_the_engine_said_it() -> None:
    body = orjson.dumps({"error": {"message": "queue full", "type": "ServiceUnavailableError", "code": 503}})
    assert not isinstance(upstream_error_from(503, body), EngineQueueFull)
