"""Streams from the real vLLM are relayed chunk by chunk, as they are made, with usage at the end."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from testing.payloads import token_ids
from testing.servers import ServerProcess, scrape_counter

pytestmark = pytest.mark.e2e

GENERATED = 1024
# On a loaded 2-core machine vLLM's own API server is sometimes starved until its engine has finished,
# and then even vLLM alone delivers a stream in one burst. A relay that buffers can never show a first
# token before the last was generated, so one attempt that does proves the relay streams.
ATTEMPTS = 6


def _stream_once(client: openai.OpenAI, vllm: ServerProcess) -> tuple[float, list[Any], dict[str, str]]:
    """One long chat stream; returns the tokens vLLM had generated when the first token reached the client."""
    messages: Any = [{"role": "user", "content": "Tell me a long story about a small model."}]
    metrics = f"{vllm.url}/metrics"
    generated_before = scrape_counter(metrics, "vllm:generation_tokens_total")
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=messages,
        max_tokens=GENERATED,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks: list[Any] = []
    generated_at_first_token: float | None = None
    for chunk in raw.parse():
        if generated_at_first_token is None and chunk.choices and chunk.choices[0].delta.content:
            generated_at_first_token = scrape_counter(metrics, "vllm:generation_tokens_total") - generated_before
        chunks.append(chunk)
    assert generated_at_first_token is not None, "the stream carried no content"
    return generated_at_first_token, chunks, dict(raw.headers)


def test_a_chat_stream_arrives_chunk_by_chunk_with_usage_last(
    client: openai.OpenAI, vllm_client: openai.OpenAI, vllm: ServerProcess
) -> None:
    seen: list[float] = []
    for _ in range(ATTEMPTS):
        generated_at_first_token, chunks, headers = _stream_once(client, vllm)
        seen.append(generated_at_first_token)
        if generated_at_first_token < GENERATED:
            break

    if min(seen) >= GENERATED:
        # Every stream came in one burst. Whether the relay is to blame shows beside vLLM alone under the same load.
        direct = [_stream_once(vllm_client, vllm)[0] for _ in range(2)]
        if min(direct) >= GENERATED:
            pytest.skip(f"vLLM alone also delivered every stream in one burst ({direct}): too busy a machine to tell")
    assert min(seen) < GENERATED, f"the first token arrived only after all {GENERATED} were generated: {seen}"
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    # One token per engine step: a relay that merged chunks would hand over far fewer.
    assert len(content_chunks) >= GENERATED // 2
    usage = chunks[-1].usage
    assert usage is not None, "the last chunk carries the usage (include_usage)"
    assert not chunks[-1].choices
    assert usage.completion_tokens == GENERATED
    assert int(headers["x-guard-prompt-tokens"]) == usage.prompt_tokens
    assert int(headers["x-guard-max-tokens"]) == GENERATED


def test_a_completion_stream_reports_the_same_prompt_count_as_its_header(client: openai.OpenAI) -> None:
    prompt = token_ids(300, seed=20)

    raw = client.completions.with_raw_response.create(
        model="tiny",
        prompt=prompt,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(raw.parse())

    usage = chunks[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == len(prompt) == int(raw.headers["x-guard-prompt-tokens"])
    assert usage.completion_tokens == 16
    assert "".join(c.choices[0].text for c in chunks if c.choices)
