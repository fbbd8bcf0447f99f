"""The gateway reads ``stream_options``, ``ignore_eos`` and ``min_tokens`` exactly as the installed vLLM's own
models validate them: every value vLLM accepts, as what it accepts it, and every value it refuses. A vLLM upgrade
that accepts a new form (or refuses one) fails here before a stream's usage or a request's booking goes wrong.

Only vLLM's protocol modules are imported (no engine, no server); they pull torch in, which takes seconds."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.engine.usage import EVERYTHING, UsageAsk, ask_engine_for_usage
from gateway.engine.vllm_api import reading

_ABSENT = object()
# Booleans, numbers, pydantic's words for true and false in every case, other words, null, containers.
VALUES: list[Any] = [
    _ABSENT, None, True, False, 0, 1, 2, -1, 0.0, 1.0, 0.5, 1.5, float("nan"),
    "true", "false", "True", "FALSE", "yes", "no", "YES", "on", "off", "On", "t", "f", "T", "y", "n", "Y",
    "1", "0", "1.0", " true", "true ", "", "maybe", "enabled", "null", "none", "2",
    [], [True], {}, {"x": 1},
]  # fmt: skip
COUNTS: list[Any] = [
    _ABSENT, None, True, False, 0, 1, 12, -3, 12.0, 12.5, "12", " 12 ", "12.0", "1e3", "twelve", "", [], {},
    2**40,
]  # fmt: skip


@pytest.fixture(scope="module")
def vllm_models() -> tuple[Any, Any, Any]:
    """vLLM's StreamOptions and its chat and completions request models."""
    with warnings.catch_warnings():  # torch and vLLM warn about themselves on import
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm", reason="vLLM is not installed here")
        from vllm.entrypoints.generate.base.protocol import StreamOptions
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    return StreamOptions, ChatCompletionRequest, CompletionRequest


def _name(value: Any) -> str:
    return "absent" if value is _ABSENT else repr(value)


def _vllm_stream_usage(stream_options: Any, options: dict[str, Any]) -> tuple[bool, bool] | None:
    """vLLM's reading: its model, then its serving code's ``should_include_usage``."""
    try:
        parsed = stream_options.model_validate(options)
    except ValidationError:
        return None
    include = bool(parsed.include_usage)
    return include, include and bool(parsed.continuous_usage_stats)


@pytest.mark.parametrize("field", ["include_usage", "continuous_usage_stats"])
@pytest.mark.parametrize("value", VALUES, ids=[_name(v) for v in VALUES])
def test_stream_options_are_read_as_vllms_model_reads_them(
    vllm_models: tuple[Any, Any, Any], field: str, value: Any
) -> None:
    stream_options = vllm_models[0]
    for other in (True, False):  # the other option set either way
        partner = "continuous_usage_stats" if field == "include_usage" else "include_usage"
        options = {partner: other} if value is _ABSENT else {partner: other, field: value}
        vllm = _vllm_stream_usage(stream_options, options)
        assert reading.stream_usage(options) == vllm, options
        sent, ask = ask_engine_for_usage({"stream": True, "stream_options": options})
        if vllm is None:  # refused: sent as it came, for vLLM's own 400
            assert sent["stream_options"] is options and ask == EVERYTHING
            continue
        assert ask == UsageAsk(*vllm)
        # Whatever the client's values, the engine is asked for usage on every chunk, as vLLM reads it.
        assert _vllm_stream_usage(stream_options, sent["stream_options"]) == (True, True)


def test_absent_or_null_options_ask_nothing_and_non_objects_are_refused_as_vllm_refuses_them(
    vllm_models: tuple[Any, Any, Any],
) -> None:
    stream_options = vllm_models[0]
    assert reading.stream_usage(None) == (False, False)
    for value in ("yes", 1, True, [], [["include_usage", True]]):
        assert _vllm_stream_usage(stream_options, value) is None  # type: ignore[arg-type]
        assert reading.stream_usage(value) is None


BASE = ({"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "hi"})  # chat, completions


def _vllm_field(model: Any, base: dict[str, Any], name: str, value: Any) -> Any:
    """The value vLLM's request model holds for ``name`` in a request that sends ``value`` (absent: its
    default); None when the model refuses the request."""
    body = dict(base) if value is _ABSENT else {**base, name: value}
    try:
        return getattr(model.model_validate(body), name)
    except ValidationError:
        return None


@pytest.mark.parametrize("model_index", [1, 2], ids=["chat", "completions"])
@pytest.mark.parametrize("value", VALUES, ids=[_name(v) for v in VALUES])
def test_ignore_eos_is_read_as_vllm_reads_it(vllm_models: tuple[Any, Any, Any], model_index: int, value: Any) -> None:
    body = {} if value is _ABSENT else {"ignore_eos": value}
    expected = _vllm_field(vllm_models[model_index], BASE[model_index - 1], "ignore_eos", value)
    assert reading.flag(body, "ignore_eos") == expected


@pytest.mark.parametrize("model_index", [1, 2], ids=["chat", "completions"])
@pytest.mark.parametrize("value", COUNTS, ids=[_name(v) for v in COUNTS])
def test_min_tokens_is_read_as_vllm_reads_it(vllm_models: tuple[Any, Any, Any], model_index: int, value: Any) -> None:
    body = {} if value is _ABSENT else {"min_tokens": value}
    expected = _vllm_field(vllm_models[model_index], BASE[model_index - 1], "min_tokens", value)
    assert reading.count(body, "min_tokens") == expected
