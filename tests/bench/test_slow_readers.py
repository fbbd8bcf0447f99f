"""The slow-readers workload: what it asks of the engine, and the gateway's memory as it reads it."""

from __future__ import annotations

import math
import os

import orjson

from bench.workloads.slow_readers import Held, request, rss_mib


def test_each_reader_asks_one_stream_of_large_tokens_produced_without_pause() -> None:
    data = request("127.0.0.1", 8080, 4000, 16384)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert f"content-length: {len(body)}".encode() in head
    asked = orjson.loads(body)
    assert (asked["stream"], asked["max_tokens"], asked["fake_token_bytes"], asked["fake_token_delay"]) == (
        True, 4000, 16384, 0)


def test_the_memory_read_is_this_processs_own_and_grows_with_it() -> None:
    before = rss_mib(os.getpid())
    ballast = bytearray(64 << 20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touched, so resident
    assert rss_mib(os.getpid()) >= before + 60
    del ballast


def test_a_run_without_a_health_answer_says_so_rather_than_a_latency() -> None:
    figures = Held(connected=5, health_failed=3).figures()
    assert math.isnan(figures["health_p50_ms"]) and figures["health_failed"] == 3
    assert Held(health_ms=[1.0, 3.0, 2.0]).figures()["health_p50_ms"] == 2.0
