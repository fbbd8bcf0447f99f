"""Every field of vLLM 0.32's request models on a guarded route, and what the gateway does with it.

A field is one of three classes:

- ``counted``: the gateway's counting or booking already follows it (the prompt's parts, the template's
  inputs, ``max_tokens`` and ``n``, what keys the prefix cache);
- ``harmless``: it changes neither the prompt the engine runs nor the KV blocks it holds, nor lets the output
  outgrow what was booked (sampling knobs, answer formatting, labels);
- ``refused``: a 400 naming the field when ``refuses(value, body)`` holds (by default: any value but null),
  because it would let the engine run another prompt, a longer one, or hold blocks the gateway cannot see.

The table is checked against vLLM's own models (``tests/e2e/test_request_fields.py``), so a field a vLLM
upgrade adds fails the suite until it is classified here. A field no model declares is ignored by vLLM
(``OpenAIBaseModel`` allows extra fields and only logs them) and passes through untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gateway.errors import UnsupportedField
from gateway.guard.counting.chatformat import has_media
from gateway.guard.prompts import is_int

FieldClass = Literal["counted", "harmless", "refused"]
Refuses = Callable[[Any, dict[str, Any]], bool]
# The guarded routes (``endpoints.table``), as named there; each maps to vLLM's request models in the e2e check.
ROUTES = ("chat", "completions", "responses", "embeddings", "pooling", "classify", "score", "rerank")

# Responses fields whose tokens live outside the request: field -> why the gateway cannot count a request that uses it
STATEFUL_FIELDS: dict[str, str] = {
    "previous_response_id": "it continues a conversation stored in the engine, whose tokens the gateway "
    "cannot see; send the whole conversation in 'input' instead",
    "conversation": "it continues a stored conversation, whose tokens the gateway cannot see; send the whole "
    "conversation in 'input' instead",
    "prompt": "it refers to a stored prompt template, which the gateway cannot render; send the prompt in "
    "'instructions' and 'input' instead",
    "previous_input_messages": "it carries engine-side (Harmony) message history, which the gateway cannot "
    "render; send the conversation in 'input' instead",
}
BACKGROUND = (
    "a background response keeps generating after the request returns, beyond the KV blocks the gateway books "
    "for it. Send it without 'background' (stream it if it is long)"
)


@dataclass(frozen=True, slots=True)
class Rule:
    kind: FieldClass
    reason: str
    refuses: Refuses | None = None  # refused fields only: whether this value is refused


def _given(value: Any, body: dict[str, Any]) -> bool:
    return value is not None


def _non_empty(value: Any, body: dict[str, Any]) -> bool:
    return value is not None and value != {} and value != []


def _true(value: Any, body: dict[str, Any]) -> bool:
    return bool(value)


def _nonzero(value: Any, body: dict[str, Any]) -> bool:
    return value is not None and value != 0


# Keys of ``extra_args`` that the engine itself reads (``v1/request.py``, ``v1/core/sched/diffusion_scheduler.py``)
ENGINE_XARGS = ("kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode")


def _engine_xargs(value: Any, body: dict[str, Any]) -> bool:
    return isinstance(value, dict) and any(k in ENGINE_XARGS or str(k).startswith("diffusion_") for k in value)


def _above_max_tokens(value: Any, body: dict[str, Any]) -> bool:
    given = (body.get("max_completion_tokens"), body.get("max_tokens"))
    bounds = [v for v in given if isinstance(v, int) and is_int(v)]
    return is_int(value) and bool(bounds) and value > min(bounds)


def _without_media(value: Any, body: dict[str, Any]) -> bool:
    if value is None or value == {}:
        return False
    messages = body.get("messages", body.get("input"))
    if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
        return not any(has_media(m) for m in messages)  # a batch of conversations
    return not has_media(messages)


def _plugin_input(value: Any, body: dict[str, Any]) -> bool:
    # vLLM reads 'data' only in a request that has no 'input' and no 'messages' (an IOProcessorRequest).
    return value is not None and body.get("input") is None and body.get("messages") is None


def counted(reason: str) -> Rule:
    return Rule("counted", reason)


def harmless(reason: str) -> Rule:
    return Rule("harmless", reason)


def refused(reason: str, when: Refuses = _given) -> Rule:
    return Rule("refused", reason, when)


# -- reasons shared by several routes ---------------------------------------------------------------
_OUTPUT = harmless("shapes the answer only")
_SAMPLING = harmless("a sampling knob: picks among the tokens, never adds one past max_tokens")
_STOPS = harmless("can only end the output earlier")
_LABEL = harmless("a label the engine does not compute with")
_MODEL = counted("selects the engine and tokenizer; the prefix salt carries it")
_STREAM = harmless("how the answer is sent; generated tokens are counted from the engine's usage")
_PRIORITY = refused(
    "it orders and preempts requests inside the engine (under --scheduling-policy priority), past the "
    "gateway's own queue; send the x-guard-priority header instead", _nonzero,
)
_REQUEST_ID = harmless("names the engine's request; vLLM suffixes its internal id, so no other request is reached")
_CACHE_SALT = counted("keys the prefix cache; the gateway salts its prefix booking with it")
_MM_KWARGS = refused(
    "only the engine's processor applies it, so the gateway counts it only with media content (through the "
    "engine's /tokenize); without media it would change a prompt the gateway counts with its own tokenizer",
    _without_media,
)
_KV_TRANSFER = refused(
    "disaggregated prefill parameters: 'prompt_token_ids' there replace the rendered prompt (vLLM runs those "
    "ids instead of the messages), and the other keys make a KV connector load or hold blocks beyond the "
    "request; the gateway books each request's prompt computed and released by the engine it is sent to",
    _non_empty,
)
_EC_TRANSFER = refused(
    "encoder-cache transfer parameters load or hold multimodal state outside the request, which the gateway "
    "cannot count", _non_empty,
)
_XARGS = refused(
    "it may carry keys the engine itself reads (kv_transfer_params, ec_transfer_params, kv_cache_report_mode, "
    "diffusion_*), a way around the refusal of those fields; other keys (for logits processors) pass",
    _engine_xargs,
)
_TRUNCATE = counted(
    "the engine keeps at most that many prompt tokens; the gateway counts the whole prompt (never less) and "
    "books it without prefix sharing, since the kept tokens need not start with a cached prefix"
)
_SIDE = counted("which end truncate_prompt_tokens cuts: the count is the same either way")
_TEMPLATE = counted("rendered by the gateway with the same template (a request template only when trusted)")
_TEMPLATE_KW = counted("passed to the chat template the gateway renders")
_TEMPLATE_FLAGS = counted("passed to the chat template the gateway renders, as vLLM does")
_SPECIAL = counted("the gateway tokenizes with the same add_special_tokens")
_LOGPROBS = harmless("the engine caps them at its --max-logprobs; with echo they become prompt logprobs (counted)")
_PROMPT_LOGPROBS = counted("the engine then skips reading the prefix cache: the gateway books the prompt whole")
_ECHO = counted("returns the prompt in the answer; with logprobs it asks prompt logprobs, booked whole")
_MIN_TOKENS = refused(
    "at most max_tokens: the engine refuses more, and the gateway books max_tokens", _above_max_tokens
)
_N = counted("the gateway books n sequences of max_tokens")
_MAX = counted("clamped to what the context leaves and booked")
_BEAM = refused(
    "beam search runs each beam as its own engine request over the whole prompt, step by step, which the "
    "gateway's one-prompt booking does not follow; sample with n instead", _true,
)
_IGNORE_EOS = harmless("runs to max_tokens, which the gateway clamps and books")
_BUDGET = harmless("bounds the reasoning inside max_tokens")
_SESSION = harmless("a label on the engine's KV events")
_POOL_OUTPUT = harmless("shapes the pooled output only")

_GENERATE_COMMON: dict[str, Rule] = {
    "model": _MODEL, "user": _LABEL, "request_id": _REQUEST_ID, "session_id": _SESSION, "priority": _PRIORITY,
    "cache_salt": _CACHE_SALT, "kv_transfer_params": _KV_TRANSFER, "ec_transfer_params": _EC_TRANSFER,
    "vllm_xargs": _XARGS, "stream": _STREAM, "mm_payload": _OUTPUT, "return_mm_kwargs": _OUTPUT,
    "seed": _SAMPLING, "temperature": _SAMPLING, "top_p": _SAMPLING, "top_k": _SAMPLING, "min_p": _SAMPLING,
    "frequency_penalty": _SAMPLING, "presence_penalty": _SAMPLING, "repetition_penalty": _SAMPLING,
    "logit_bias": _SAMPLING, "structured_outputs": _SAMPLING, "watermarking": _SAMPLING,
    "stop": _STOPS, "stop_token_ids": _STOPS, "ignore_eos": _IGNORE_EOS, "skip_special_tokens": _OUTPUT,
    "include_stop_str_in_output": _OUTPUT,
}
_CHAT_COMPLETIONS_COMMON: dict[str, Rule] = {
    **_GENERATE_COMMON,
    "max_tokens": _MAX, "n": _N, "min_tokens": _MIN_TOKENS, "use_beam_search": _BEAM,
    "length_penalty": harmless("applies to beam search only, which is refused"),
    "truncate_prompt_tokens": _TRUNCATE, "truncation_side": _SIDE, "add_special_tokens": _SPECIAL,
    "echo": _ECHO, "logprobs": _LOGPROBS, "prompt_logprobs": _PROMPT_LOGPROBS, "logprob_token_ids": _LOGPROBS,
    "return_tokens_as_token_ids": _OUTPUT, "return_token_ids": _OUTPUT, "return_token_offsets": _OUTPUT,
    "routed_experts_prompt_start": _OUTPUT, "spaces_between_special_tokens": _OUTPUT,
    "allowed_token_ids": _SAMPLING, "bad_words": _SAMPLING, "response_format": _SAMPLING,
    "stream_options": _STREAM, "stream_interval": _STREAM, "thinking_token_budget": _BUDGET,
    "repetition_detection": _STOPS,
}

CHAT: dict[str, Rule] = {
    **_CHAT_COMPLETIONS_COMMON,
    "messages": counted("rendered with the model's chat template and counted"),
    "tools": _TEMPLATE_KW, "documents": _TEMPLATE_KW, "chat_template": _TEMPLATE,
    "chat_template_kwargs": _TEMPLATE_KW, "add_generation_prompt": _TEMPLATE_FLAGS,
    "continue_final_message": _TEMPLATE_FLAGS, "reasoning_effort": _TEMPLATE_KW,
    "max_completion_tokens": _MAX, "mm_processor_kwargs": _MM_KWARGS, "media_io_kwargs": _MM_KWARGS,
    "tool_choice": counted("'none' may leave the tools out of the prompt; the gateway counts them (never less)"),
    "parallel_tool_calls": _OUTPUT, "include_reasoning": _OUTPUT, "top_logprobs": _LOGPROBS,
    "return_prompt_text": _OUTPUT,
}

COMPLETIONS: dict[str, Rule] = {
    **_CHAT_COMPLETIONS_COMMON,
    "prompt": counted("tokenized (or taken as ids) and counted, one engine request per prompt"),
    "suffix": refused(
        "a fill-in-the-middle model renders it around the prompt (vLLM's render_completion_suffix), text the "
        "gateway does not count; other models refuse it anyway"
    ),
    "prompt_embeds": refused(
        "embeddings are a prompt the gateway cannot count (and they may come beside 'prompt' as more prompts); "
        "send text or token ids in 'prompt'"
    ),
}

RESPONSES: dict[str, Rule] = {
    **_GENERATE_COMMON,
    "input": counted("turned into chat messages as vLLM does and rendered with the chat template"),
    "instructions": counted("the first system message of the rendered prompt"),
    "tools": counted("function, custom and namespace tools are rendered; built-in tools are not shown to the model"),
    "chat_template_kwargs": _TEMPLATE_KW, "reasoning": counted("its effort goes to the chat template"),
    "max_output_tokens": _MAX, "mm_processor_kwargs": _MM_KWARGS, "media_io_kwargs": _MM_KWARGS,
    "truncation": counted("a prompt over the limit is refused whatever it says"),
    # vLLM 0.32's model has no 'conversation' (it ignores one); responses.refuse_stateful still refuses it.
    **{name: refused(why) for name, why in STATEFUL_FIELDS.items() if name != "conversation"},
    "background": refused(BACKGROUND, _true),
    "store": harmless("keeps the answer in the API server's memory, not in KV blocks"),
    "max_tool_calls": harmless(
        "bounds built-in tool turns, which vLLM runs only for Harmony models (not counted by this gateway anyway)"
    ),
    "tool_choice": _SAMPLING, "parallel_tool_calls": _OUTPUT, "include": _OUTPUT, "include_reasoning": _OUTPUT,
    "enable_response_messages": _OUTPUT, "metadata": _LABEL, "service_tier": _LABEL,
    "prompt_cache_key": harmless("vLLM ignores it"), "text": _SAMPLING, "top_logprobs": _LOGPROBS,
}

_POOLING_COMMON: dict[str, Rule] = {
    "model": _MODEL, "user": _LABEL, "request_id": _REQUEST_ID, "priority": _PRIORITY,
    "cache_salt": harmless("keys the engine's prefix cache; pooling prompts are booked whole, never shared"),
    "truncate_prompt_tokens": counted("the gateway counts each prompt as the engine truncates it"),
    "truncation_side": _SIDE, "padding": counted("'max_length' pads each prompt to the context; counted so"),
    "mm_processor_kwargs": _MM_KWARGS, "use_activation": _POOL_OUTPUT,
}
_ENCODING: dict[str, Rule] = {
    **_POOLING_COMMON,
    "input": counted("each text or id list is one prompt, counted"),
    "messages": counted("rendered with the chat template and counted"),
    "add_special_tokens": _SPECIAL, "chat_template": _TEMPLATE, "chat_template_kwargs": _TEMPLATE_KW,
    "add_generation_prompt": _TEMPLATE_FLAGS, "continue_final_message": _TEMPLATE_FLAGS,
    "media_io_kwargs": _MM_KWARGS,
}
_EMBED_OUTPUT = {"dimensions": _POOL_OUTPUT, "embed_dtype": _POOL_OUTPUT, "encoding_format": _POOL_OUTPUT,
                 "endianness": _POOL_OUTPUT}  # fmt: skip
_SCORE_TEMPLATE = refused(
    "it goes into a score template the gateway cannot render, once per pair; send the texts alone", _non_empty
)
SCORING: dict[str, Rule] = {
    **_POOLING_COMMON,
    "max_tokens_per_query": counted("bounds each first text; counted so"),
    "max_tokens_per_doc": counted("bounds each second text; counted so"),
    "instruction": _SCORE_TEMPLATE, "chat_template_kwargs": _SCORE_TEMPLATE,
}

TABLE: dict[str, dict[str, Rule]] = {
    "chat": CHAT,
    "completions": COMPLETIONS,
    "responses": RESPONSES,
    "embeddings": {**_ENCODING, **_EMBED_OUTPUT},
    "pooling": {
        **_ENCODING, **_EMBED_OUTPUT,
        "task": harmless("which pooled output the engine returns; the prompt is the same"),
        "data": refused(
            "input for an IO processor plugin: only the plugin knows its prompts, so the gateway cannot count "
            "them; send 'input' or 'messages'", _plugin_input,
        ),
    },
    "classify": dict(_ENCODING),
    "score": {
        **SCORING,
        **{name: counted("paired with the other side's texts and counted per pair")
           for name in ("text_1", "text_2", "queries", "documents", "items", "data_1", "data_2")},
    },
    "rerank": {
        **SCORING,
        "query": counted("paired with each document and counted per pair"),
        "documents": counted("paired with the query and counted per pair"),
        "top_n": _POOL_OUTPUT,
    },
}


def check(route: str, body: dict[str, Any]) -> None:
    """Refuse the first field of ``body`` the table refuses on ``route``, naming it and saying why."""
    rules = TABLE[route]
    for name, value in body.items():
        rule = rules.get(name)
        if rule is not None and rule.refuses is not None and rule.refuses(value, body):
            raise UnsupportedField(f"'{name}' is not supported through this gateway: {rule.reason}.", param=name)
