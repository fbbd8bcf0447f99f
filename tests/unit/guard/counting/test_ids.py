"""Prompt token ids: exactly the tokenizer's own, from the piece cache as from whole text, unknown for media."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from tokenizers import processors

from bench.workloads.counting import synthetic_chat
from gateway.guard.counting import LocalCounter, PromptTokens, RemoteCounter, TextCounter
from gateway.guard.counting.templates import RequestTemplates, TemplateLimits
from tests.unit.guard.counting.chats import U, reference_ids, turn
from tests.unit.guard.counting.test_local import CHAT_BODIES, PROMPTS

# How a tokenizer surrounds a text it encodes with add_special_tokens, and whether its text splits into pieces.
VARIANTS = ["prepends BOS", "wraps in BOS and EOS", "adds nothing", "treats special tokens as text"]

TEXTS = [
    "",
    "Hello world",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    " <|im_start|>  \n\n<|im_end|><|im_end|>z",
    "<s><s> </s>\t<pad>a",
    "héllo<|im_start|>wörld   <|im_end|>\n",
    "<|im_start|" + "im_end|>",
]


def variant(tokenizer: Any, name: str) -> Any:
    tok = copy.deepcopy(tokenizer)
    if name == "wraps in BOS and EOS":
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", tok.bos_token_id), ("</s>", tok.eos_token_id)]
        )
    elif name == "adds nothing":
        tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    elif name == "treats special tokens as text":
        tok.split_special_tokens = True
    return tok


@pytest.fixture(scope="module")
def text_counters(tokenizer: Any) -> dict[str, tuple[Any, TextCounter]]:
    out = {}
    for name in VARIANTS:
        tok = variant(tokenizer, name)
        out[name] = (tok, TextCounter(tok))
    return out


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_text_ids_equal_the_tokenizers_own_for_every_kind_of_tokenizer(
    text_counters: dict[str, tuple[Any, TextCounter]], name: str, text: str, add_special_tokens: bool
) -> None:
    tok, counter = text_counters[name]
    assert counter.splits_at_special_tokens == (name != "treats special tokens as text")
    expected = tuple(tok(text, add_special_tokens=add_special_tokens)["input_ids"])
    for _ in range(2):  # tokenized, then from the cache
        assert counter.ids(text, add_special_tokens) == expected
        assert counter.count(text, add_special_tokens) == len(expected)


@pytest.mark.parametrize(("case", "body"), CHAT_BODIES, ids=[c for c, _ in CHAT_BODIES])
async def test_chat_ids_equal_the_tokenizers_own(tokenizer: Any, case: str, body: dict[str, Any]) -> None:
    counter = LocalCounter(tokenizer)
    expected = reference_ids(tokenizer, body)
    for _ in range(2):  # tokenized, then from the cache
        assert await counter.tokenize_chat(body) == PromptTokens(len(expected), expected)
    assert await counter.count_chat(body) == len(expected)


@pytest.mark.parametrize(("prompt", "add_special_tokens"), PROMPTS)
async def test_prompt_ids_are_the_tokenizers_own_and_token_ids_as_given(
    counter: LocalCounter, tokenizer: Any, prompt: Any, add_special_tokens: bool
) -> None:
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    expected = [
        tuple(p) if isinstance(p, list) else tuple(tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"])
        for p in prompts
    ]
    tokens = await counter.tokenize_prompts(prompt, add_special_tokens=add_special_tokens)
    assert tokens == [PromptTokens(len(ids), ids) for ids in expected]
    assert [t.count for t in tokens] == await counter.count_prompts(prompt, add_special_tokens=add_special_tokens)


class RecordingEncoder:
    """Wraps a text counter's batch encoder and remembers each piece it had to tokenize."""

    def __init__(self, counter: LocalCounter, monkeypatch: Any) -> None:
        self.pieces: list[str] = []
        real = counter.text._encode

        def recording(pieces: list[str]) -> list[list[int]]:
            self.pieces.extend(pieces)
            return real(pieces)

        monkeypatch.setattr(counter.text, "_encode", recording)


async def test_a_second_tokenization_takes_every_id_from_the_cache(tokenizer: Any, monkeypatch: Any) -> None:
    counter = LocalCounter(tokenizer)
    encoder = RecordingEncoder(counter, monkeypatch)
    body = synthetic_chat(tokenizer, 2000)
    first = await counter.tokenize_chat(body)
    assert encoder.pieces
    encoder.pieces.clear()
    assert await counter.tokenize_chat(body) == first
    assert encoder.pieces == []
    assert first.ids == reference_ids(tokenizer, body)


async def test_a_growing_conversation_tokenizes_only_its_new_turns(tokenizer: Any, monkeypatch: Any) -> None:
    counter = LocalCounter(tokenizer)
    encoder = RecordingEncoder(counter, monkeypatch)
    messages = synthetic_chat(tokenizer, 3000)["messages"]
    for turns in range(2, len(messages) + 1):
        body = {"messages": messages[:turns]}
        encoder.pieces.clear()
        tokens = await counter.tokenize_chat(body)
        assert tokens.ids == reference_ids(tokenizer, body) and tokens.count == len(tokens.ids)
        older = messages[turns - 2]["content"]
        assert turns == 2 or not any(older in piece for piece in encoder.pieces)


async def test_cached_ids_share_one_int_object_per_vocabulary_id(tokenizer: Any) -> None:
    counter = LocalCounter(tokenizer)
    body = synthetic_chat(tokenizer, 1000)
    first = await counter.tokenize_chat(body)
    again = await counter.tokenize_chat(body)
    assert again == first
    assert max(again.ids or ()) > 256  # past the ints Python itself shares
    assert all(i is counter.text._ints[i] for i in again.ids or ())


def test_an_id_beyond_the_reported_vocabulary_is_cached_as_it_came(tokenizer: Any) -> None:
    counter = TextCounter(tokenizer)
    counter._ints = counter._ints[:10]
    text = "<|im_start|>user\nHello there, world<|im_end|>"
    expected = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert max(expected) >= 10
    assert counter.ids(text) == counter.ids(text) == expected


@pytest.mark.parametrize("cache_bytes", [0, 64, 2000])
async def test_ids_stay_exact_when_the_cache_holds_little_or_nothing(tokenizer: Any, cache_bytes: int) -> None:
    counter = LocalCounter(tokenizer, cache_bytes=cache_bytes)
    messages = synthetic_chat(tokenizer, 1500)["messages"]
    for turns in (len(messages) - 1, len(messages), len(messages)):
        body = {"messages": messages[:turns]}
        assert (await counter.tokenize_chat(body)).ids == reference_ids(tokenizer, body)


MEDIA_BODIES = [
    ("an image part", {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}),
    ("an audio part", {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}),
    ("a media part without a type", {"image_url": {"url": "data:x"}}),
]


def media_chat(part: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]}


async def engine_tokenize(payload: dict[str, Any]) -> dict[str, Any]:
    """An engine's /tokenize for a media chat: placeholder ids, which are not the media's prefix keys."""
    return {"count": 5, "max_model_len": 2048, "tokens": [7, 8, 9, 9, 9]}


@pytest.mark.parametrize(("case", "part"), MEDIA_BODIES, ids=[c for c, _ in MEDIA_BODIES])
async def test_media_parts_leave_the_ids_unknown(tokenizer: Any, case: str, part: dict[str, Any]) -> None:
    remote = RemoteCounter(engine_tokenize, "tiny")
    local = LocalCounter(tokenizer, fallback=remote)
    body = media_chat(part)
    assert await local.tokenize_chat(body) == PromptTokens(5, None)
    assert await remote.tokenize_chat(body) == PromptTokens(5, None)


async def test_a_request_template_gives_the_ids_of_the_text_it_renders(tokenizer: Any) -> None:
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    templates = RequestTemplates(trusted=True, limits=TemplateLimits(timeout=5.0, max_chars=100_000))
    try:
        counter = LocalCounter(tokenizer, templates=templates)
        body = {"messages": [U, turn("assistant", 30, "a"), U], "chat_template": template}
        text = tokenizer.apply_chat_template(body["messages"], chat_template=template, tokenize=False)
        expected = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert await counter.tokenize_chat(body) == PromptTokens(len(expected), expected)
        assert await counter.count_chat(body) == len(expected)
    finally:
        await templates.close()
