"""The text counter: split at special tokens, cached by piece, always equal to whole-text counts."""

from __future__ import annotations

from typing import Any

import pytest

from bench.workloads.counting import synthetic_chat
from gateway.guard.counting import LocalCounter
from tests.unit.guard.counting.chats import reference


async def test_a_growing_conversation_reuses_what_was_counted(tokenizer: Any, monkeypatch: Any) -> None:
    counter = LocalCounter(tokenizer)
    uncached = LocalCounter(tokenizer, cache_bytes=0)
    encoded: list[str] = []
    real = counter.text._encode

    def recording(pieces: list[str]) -> list[list[int]]:
        encoded.extend(pieces)
        return real(pieces)

    monkeypatch.setattr(counter.text, "_encode", recording)
    messages = synthetic_chat(tokenizer, 3000)["messages"]
    for turns in range(2, len(messages) + 1):
        body = {"messages": messages[:turns]}
        encoded.clear()
        n = await counter.count_chat(body)
        assert n == await uncached.count_chat(body) == reference(tokenizer, body)
        # Only the newest turn (and the generation prompt) is tokenized again.
        older = messages[turns - 2]["content"]
        assert turns == 2 or not any(older in piece for piece in encoded)


SPLIT_TEXTS = [
    "",
    "<|im_start|>",
    "x<|im_end|> y",
    " <|im_start|>  \n\n<|im_end|><|im_end|>z",
    "<s><s> </s>\t<pad>a",
    "héllo<|im_start|>wörld   <|im_end|>\n",
    "<|im_start|" + "im_end|>",
]


@pytest.mark.parametrize("text", SPLIT_TEXTS)
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_text_split_at_special_tokens_counts_like_the_whole(
    counter: LocalCounter, tokenizer: Any, text: str, add_special_tokens: bool
) -> None:
    assert counter.text.splits_at_special_tokens
    expected = len(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    assert counter.text.count(text, add_special_tokens) == expected
