"""The clients of the realistic benchmark: each sends one run's planned chat streams at their arrival times and
returns what it saw of each (``Outcome``).

- ``aiohttp``: a light client, so that the client takes little of the machine's two cores; it sends
  ``x-stainless-read-timeout`` as the OpenAI SDKs do;
- ``sdk``: the OpenAI Python SDK (``max_retries=0``, so that a refusal is counted, not retried);
- ``vllm``: vLLM's own benchmark client, in-process, replaying the same arrival times.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import aiohttp

from bench.workloads.realistic import Outcome, Planned, length_body
from testing.servers import SERVED_MODEL_NAME

Send = Callable[[int, Planned, str, float], Coroutine[Any, Any, Outcome]]


def chat_body(planned: Planned, text: str, eos_id: int) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": planned.max_tokens,
        "stream": True, "stream_options": {"include_usage": True}, **length_body(planned.length, eos_id),
    }  # fmt: skip


async def _aiohttp_one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], read_timeout: float,
                       planned: Planned, start: float) -> Outcome:
    sent, sent_wall = time.monotonic(), time.time()
    ttft: float | None = None
    first_wall = 0.0
    tokens = 0
    status: int | None = None
    rid = ""
    try:
        async with session.post(url, json=body, headers={"x-stainless-read-timeout": f"{read_timeout:g}"}) as resp:
            status, rid = resp.status, resp.headers.get("x-request-id", "")
            if status != 200:
                await resp.read()
                return Outcome(planned.at, status, None, 0, time.monotonic() - start)
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if ttft is None:
                    ttft, first_wall = time.monotonic() - sent, time.time()
                data = line[6:].strip()
                if data != b"[DONE]":
                    usage = json.loads(data).get("usage")
                    if usage:
                        tokens = int(usage["completion_tokens"])
    except (TimeoutError, aiohttp.ServerTimeoutError):
        return Outcome(planned.at, status, ttft, 0, time.monotonic() - start, timed_out=True)
    except (aiohttp.ClientError, ValueError, KeyError) as exc:
        return Outcome(planned.at, None, ttft, 0, time.monotonic() - start, error=repr(exc))
    return Outcome(planned.at, status, ttft, tokens, time.monotonic() - start, request_id=rid, sent_wall=sent_wall,
                   first_wall=first_wall)


async def _dispatch(plans: Sequence[Planned], texts: Sequence[str], send: Send) -> list[Outcome]:
    """Sends each planned request at its arrival time (not after the previous answer: an open loop)."""
    start = time.monotonic()
    tasks: list[asyncio.Task[Outcome]] = []
    for i, (planned, text) in enumerate(zip(plans, texts, strict=True)):
        delay = start + planned.at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(i, planned, text, start)))
    return list(await asyncio.gather(*tasks))


async def run_aiohttp(base: str, plans: Sequence[Planned], texts: Sequence[str], eos_id: int,
                      read_timeout: float) -> list[Outcome]:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_timeout)
    # Idle connections are dropped after 3 s, before vLLM's 5-s keep-alive closes them under a request.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        url = f"{base}/v1/chat/completions"

        async def send(i: int, planned: Planned, text: str, start: float) -> Outcome:
            return await _aiohttp_one(session, url, chat_body(planned, text, eos_id), read_timeout, planned, start)

        return await _dispatch(plans, texts, send)


async def run_sdk(base: str, plans: Sequence[Planned], texts: Sequence[str], eos_id: int,
                  read_timeout: float) -> list[Outcome]:
    import openai

    # The SDK sends its timeout as x-stainless-read-timeout; its pool (1,000 connections) is no limit here.
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                                  timeout=read_timeout) as client:
        await client.models.list()  # the SDK's first call builds its models (~1.5 s here): not a request's TTFT

        async def send(i: int, planned: Planned, text: str, start: float) -> Outcome:
            sent = time.monotonic()
            ttft: float | None = None
            tokens = 0
            try:
                stream = await client.chat.completions.create(
                    model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": text}],
                    max_tokens=planned.max_tokens, stream=True, stream_options={"include_usage": True},
                    extra_body=length_body(planned.length, eos_id),
                )
                async for chunk in stream:
                    ttft = ttft if ttft is not None else time.monotonic() - sent
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
            except openai.APITimeoutError:
                return Outcome(planned.at, None, ttft, 0, time.monotonic() - start, timed_out=True)
            except openai.APIStatusError as exc:
                return Outcome(planned.at, exc.status_code, None, 0, time.monotonic() - start)
            except openai.APIError as exc:
                return Outcome(planned.at, None, ttft, 0, time.monotonic() - start, error=repr(exc))
            return Outcome(planned.at, 200, ttft, tokens, time.monotonic() - start)

        return await _dispatch(plans, texts, send)


def _vllm_outcome(planned: Planned, result: dict[str, Any], i: int, first_start: float) -> Outcome:
    error = str(result["errors"][i] or "")
    end = planned.at + float(result["start_times"][i]) - first_start + float(result["latencies"][i])
    if not error:
        return Outcome(planned.at, 200, float(result["ttfts"][i]), int(result["output_lens"][i]), end)
    status = next((code for code in (429, 503, 400, 500) if str(code) in error), None)
    return Outcome(planned.at, status, None, 0, end, timed_out="timeout" in error.lower(), error=error)


async def run_vllm_bench(base: str, plans: Sequence[Planned], texts: Sequence[str], eos_id: int,
                         read_timeout: float, tokenizer_dir: str) -> list[Outcome]:
    """vLLM's own benchmark client (``vllm bench serve``'s ``benchmark``, chat backend) replaying the plan's
    arrival times (``self_timed``), each request with its own bias on EOS; it has no read timeout
    of its own (6 h). Its single-request check before the run sends the first request once more."""
    import contextlib

    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType, benchmark
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(tokenizer_dir)
    requests = [
        SampleRequest(prompt=text, prompt_len=len(tokenizer.encode(text)), expected_output_len=planned.max_tokens,
                      timestamp=planned.at, request_overrides=length_body(planned.length, eos_id))
        for planned, text in zip(plans, texts, strict=True)
    ]  # fmt: skip
    with contextlib.redirect_stdout(sys.stderr):  # its report goes with the progress lines
        result = await benchmark(
            task_type=TaskType.GENERATION, endpoint_type="openai-chat", api_url=f"{base}/v1/chat/completions",
            base_url=base, model_id=SERVED_MODEL_NAME, model_name=SERVED_MODEL_NAME, tokenizer=tokenizer,
            input_requests=requests, logprobs=None, request_rate=float("inf"), burstiness=1.0, disable_tqdm=True,
            num_warmups=0, profile=False, selected_percentile_metrics=["ttft"], selected_percentiles=[99.0],
            ignore_eos=False, goodput_config_dict={}, max_concurrency=None, lora_modules=None, extra_headers=None,
            extra_body={"stream_options": {"include_usage": True}}, self_timed=True,
        )
    first_start = min(float(t) for t in result["start_times"])
    return [_vllm_outcome(p, result, i, first_start) for i, p in enumerate(plans)]


CLIENTS = {"aiohttp": run_aiohttp, "sdk": run_sdk}
