"""The pooling routes (embeddings, pooling, classify, score, rerank): the prompts vLLM 0.32 builds, to count them.

A pooling request generates nothing, but each of its prompts is one engine request that holds KV blocks
for its prompt while it runs, and vLLM refuses one longer than the context. The shapes follow vLLM's
protocols (``entrypoints/pooling/*/protocol.py``):

- ``/v1/embeddings``, ``/pooling``, ``/classify``: ``input`` as a string, a list of strings, token ids or a
  list of token-id lists (one prompt each, special tokens added unless ``add_special_tokens`` is false); or a
  chat conversation in ``messages`` (rendered with the chat template, no generation prompt and no special
  tokens by default). ``/v1/embeddings`` also takes a batch of conversations in ``messages``, and
  conversations given in ``input``.
- ``/score`` and ``/v1/score``: ``text_1``/``text_2`` (or ``queries`` with ``documents`` or ``items``, or
  ``data_1``/``data_2``), each a string or a list; one first text pairs with every second one (1:N), or
  they pair up in order (N:N). ``/rerank`` (``/v1``, ``/v2``): one ``query`` paired with every ``documents``
  entry. A pair is counted as the tokenizer encodes a text pair (``tokenizer(text, text_pair)``: both
  texts' tokens and the pair's special tokens), which is exactly what a cross-encoder is given. Models that
  score differently (an embedding model encoding each text alone, an LLM reranker concatenating them, or a
  score template) are counted conservatively: a pair is never shorter than each text alone.
- ``truncate_prompt_tokens`` (``-1``: the engine's context) cuts each prompt in the engine, and
  ``padding: "max_length"`` pads each to the context; counts follow both. ``max_tokens_per_query`` and
  ``max_tokens_per_doc`` bound each text of a pair.

Inputs the gateway cannot count (multimodal score inputs, plugin ``data``) are refused with a 400, and so are
the fields ``fields`` refuses (every parser checks them first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.config import PromptOverflowPolicy
from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.guard import fields
from gateway.guard.endpoints.base import Endpoint, model_field
from gateway.guard.policy import Limits
from gateway.guard.prompts import flag, is_ids, is_int, json_type

if TYPE_CHECKING:
    from gateway.guard.counting import Counter

PROMPT_FIELDS = ("input", "messages")
SCORE_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))


@dataclass(frozen=True, slots=True)
class Texts:
    """One prompt per entry: text, or token ids (counted as given)."""

    prompts: list[str | list[int]]
    add_special_tokens: bool


@dataclass(frozen=True, slots=True)
class Chats:
    """One prompt per conversation: the chat request as vLLM renders it."""

    bodies: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Pairs:
    """One prompt per (first, second) text pair; a bound of 0 leaves that side whole."""

    pairs: list[tuple[str, str]]
    max_first: int = 0
    max_second: int = 0


Inputs = Texts | Chats | Pairs


@dataclass(frozen=True, slots=True)
class PoolingRequest:
    """A pooling route's request as validated. ``body``: the client's, never edited."""

    endpoint: Endpoint[PoolingRequest]
    body: dict[str, Any]
    model: str | None
    inputs: Inputs
    params: list[str]  # where each prompt came from, for errors ("input[2]", "documents[0]")
    truncate_prompt_tokens: int | None = None
    pad_to_context: bool = False

    @property
    def route(self) -> str:
        return self.endpoint.name


# -- parsing ---------------------------------------------------------------------------------------
def parse_embeddings(body: dict[str, Any]) -> PoolingRequest:
    fields.check(EMBEDDINGS.name, body)
    return _parse_encoding(EMBEDDINGS, body, batches=True)


def parse_pooling(body: dict[str, Any]) -> PoolingRequest:
    fields.check(POOLING.name, body)  # an IO processor plugin's 'data' among them
    return _parse_encoding(POOLING, body, batches=False)


def parse_classify(body: dict[str, Any]) -> PoolingRequest:
    fields.check(CLASSIFY.name, body)
    return _parse_encoding(CLASSIFY, body, batches=False)


def parse_score(body: dict[str, Any]) -> PoolingRequest:
    fields.check(SCORE.name, body)
    named = [(a, b) for a, b in SCORE_FIELDS if body.get(a) is not None or body.get(b) is not None]
    whole = [(a, b) for a, b in named if body.get(a) is not None and body.get(b) is not None]
    if named:
        first, second = (whole or named)[0]
        return _parse_pairs(SCORE, body, first, second)
    raise InvalidRequest(
        "A score request needs 'text_1' and 'text_2' (or 'queries' with 'documents' or 'items', or 'data_1' "
        "and 'data_2').",
        param="text_1",
    )


def parse_rerank(body: dict[str, Any]) -> PoolingRequest:
    fields.check(RERANK.name, body)
    if isinstance(body.get("query"), list):
        raise InvalidRequest("'query' must be one string, not a list.", param="query")
    return _parse_pairs(RERANK, body, "query", "documents")


EMBEDDINGS = Endpoint("embeddings", ("/v1/embeddings",), "pooling", parse_embeddings, operation="embeddings")
POOLING = Endpoint("pooling", ("/pooling",), "pooling", parse_pooling)
CLASSIFY = Endpoint("classify", ("/classify",), "pooling", parse_classify)
SCORE = Endpoint("score", ("/score", "/v1/score"), "pooling", parse_score)
RERANK = Endpoint("rerank", ("/rerank", "/v1/rerank", "/v2/rerank"), "pooling", parse_rerank)


def _parse_encoding(endpoint: Endpoint[PoolingRequest], body: dict[str, Any], *, batches: bool) -> PoolingRequest:
    messages, raw = body.get("messages"), body.get("input")
    if messages is not None and raw is not None:
        raise InvalidRequest("Send either 'input' or 'messages', not both.", param="messages")
    if messages is None and batches and (_is_conversation(raw) or _is_batch(raw)):
        messages, where = raw, "input"
    else:
        where = "messages"
    if messages is not None:
        conversations = messages if batches and _is_batch(messages) else [messages]
        if not _is_conversation(conversations[0]):
            raise InvalidRequest(
                f"'{where}' must be a list of chat messages (objects with a 'role')"
                + (", or a list of such lists." if batches else "."),
                param=where,
            )
        bodies = [_chat_body(body, c) for c in conversations]
        params = [where] if len(bodies) == 1 else [f"{where}[{i}]" for i in range(len(bodies))]
        inputs: Inputs = Chats(bodies)
    else:
        prompts = _prompt_list(raw)
        params = ["input"] if not isinstance(raw, list) or is_ids(raw) else [f"input[{i}]" for i in range(len(raw))]
        inputs = Texts(prompts, flag(body, "add_special_tokens", True))
    return PoolingRequest(endpoint, body, model_field(body), inputs, params, *_length_options(body))


def _parse_pairs(endpoint: Endpoint[PoolingRequest], body: dict[str, Any], first: str, second: str) -> PoolingRequest:
    firsts, seconds = _texts(body.get(first), first), _texts(body.get(second), second)
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise InvalidRequest(
            f"'{first}' and '{second}' must pair 1:N or N:N; got {len(firsts)} and {len(seconds)} entries.",
            param=second,
        )
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    bounds = [_non_negative(body, name) for name in ("max_tokens_per_query", "max_tokens_per_doc")]
    params = [second if len(seconds) == 1 and not isinstance(body.get(second), list) else f"{second}[{i}]"
              for i in range(len(seconds))]  # fmt: skip
    inputs = Pairs(list(zip(firsts, seconds, strict=True)), *bounds)
    return PoolingRequest(endpoint, body, model_field(body), inputs, params, *_length_options(body))


def _chat_body(body: dict[str, Any], conversation: list[Any]) -> dict[str, Any]:
    """The chat request vLLM renders for one conversation of a pooling request (its own defaults)."""
    chat: dict[str, Any] = {
        "messages": conversation,
        "add_generation_prompt": flag(body, "add_generation_prompt", False),
        "continue_final_message": flag(body, "continue_final_message", False),
        "add_special_tokens": flag(body, "add_special_tokens", False),
    }
    for key in ("chat_template", "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs"):
        if body.get(key) is not None:
            chat[key] = body[key]
    return chat


def _prompt_list(raw: Any) -> list[str | list[int]]:
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw:
        if all(isinstance(p, str) for p in raw):
            return list(raw)
        if is_ids(raw):
            return [list(raw)]
        if all(is_ids(p) for p in raw):
            return [list(p) for p in raw]
    raise InvalidRequest(
        "'input' must be a string, a non-empty list of strings, a list of token ids, or a list of non-empty token "
        f"id lists; got {json_type(raw)}.",
        param="input",
    )


def _texts(raw: Any, name: str) -> list[str]:
    values = raw if isinstance(raw, list) else [raw]
    if not values:
        raise InvalidRequest(f"'{name}' must not be an empty list.", param=name)
    for i, v in enumerate(values):
        if isinstance(v, dict):
            raise InvalidRequest(
                f"{name}[{i}] is multimodal content, which only the engine can count; this gateway scores text only.",
                param=f"{name}[{i}]" if isinstance(raw, list) else name,
            )
        if not isinstance(v, str):
            raise InvalidRequest(
                f"'{name}' must be a string or a list of strings; got {json_type(v)}.",
                param=f"{name}[{i}]" if isinstance(raw, list) else name,
            )
    return list(values)


def _length_options(body: dict[str, Any]) -> tuple[int | None, bool]:
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (not is_int(truncate) or truncate < -1):
        raise InvalidRequest(
            f"'truncate_prompt_tokens' must be an integer of at least -1; got {truncate!r}.",
            param="truncate_prompt_tokens",
        )
    padding = body.get("padding")
    if padding not in (None, "max_length", "do_not_pad"):
        raise InvalidRequest(f"'padding' must be 'max_length' or 'do_not_pad'; got {padding!r}.", param="padding")
    return truncate, padding == "max_length"


# -- counting and the context ---------------------------------------------------------------------
async def count(counter: Counter, inputs: Inputs) -> list[int]:
    """Each prompt's tokens before the engine truncates or pads it."""
    if isinstance(inputs, Texts):
        return await counter.count_prompts(
            inputs.prompts,  # type: ignore[arg-type]  # one list, one shape (parsing checked it)
            add_special_tokens=inputs.add_special_tokens,
        )
    if isinstance(inputs, Chats):
        return [await counter.count_chat(b) for b in inputs.bodies]
    return await counter.count_pairs(inputs.pairs, max_first=inputs.max_first, max_second=inputs.max_second)


def fit_context(
    req: PoolingRequest, counts: list[int], limits: Limits, policy: PromptOverflowPolicy, engine_max_model_len: int
) -> tuple[list[int], int, int | None]:
    """The prompts' lengths as the engine will run them, the tokens cut by truncation, and the
    ``truncate_prompt_tokens`` the engine is to be sent in place of the client's (None: the client's stands).

    Every prompt must fit the context (a pooling prompt may fill it: nothing is generated). Over it, the
    ``reject`` policy answers 400; ``truncate`` asks the engine to cut each prompt to the limit (vLLM's own
    ``truncate_prompt_tokens``). A client's ``truncate_prompt_tokens`` is honoured either way.
    """
    truncate = req.truncate_prompt_tokens
    if truncate is not None and truncate > engine_max_model_len:
        raise InvalidRequest(
            f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len={engine_max_model_len}.",
            param="truncate_prompt_tokens",
        )
    cap = limits.max_model_len if limits.max_prompt_tokens is None else min(
        limits.max_model_len, limits.max_prompt_tokens
    )
    lengths = [_engine_length(c, truncate, req.pad_to_context, engine_max_model_len) for c in counts]
    cut, sent = 0, None
    engine_cuts_enough = truncate is not None and 0 <= truncate <= cap
    if policy == "truncate" and any(n > cap for n in lengths) and not engine_cuts_enough:
        sent = cap
        cut = sum(max(0, n - cap) for n in lengths)
        lengths = [_engine_length(c, cap, req.pad_to_context, engine_max_model_len) for c in counts]
    for n, where in zip(lengths, req.params, strict=True):
        if n > cap:
            raise ContextLengthExceeded(_too_long(n, where, limits, cap), param=where)
    return lengths, cut, sent


def _engine_length(tokens: int, truncate: int | None, pad: bool, engine_max_model_len: int) -> int:
    if truncate is not None:
        tokens = min(tokens, engine_max_model_len if truncate == -1 else truncate)
    return max(tokens, engine_max_model_len) if pad else tokens


def _too_long(tokens: int, where: str, limits: Limits, cap: int) -> str:
    if cap < limits.max_model_len:
        head = (
            f"This gateway accepts prompts of at most {cap} tokens (the model's maximum context length is "
            f"{limits.max_model_len} tokens)"
        )
    else:
        head = f"This model's maximum context length is {limits.max_model_len} tokens"
    return (
        f"{head}; {where} uses {tokens} tokens. Shorten it, set truncate_prompt_tokens, or send "
        "x-guard-on-overflow: truncate."
    )


# -- small helpers ---------------------------------------------------------------------------------
def _is_conversation(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in v)


def _is_batch(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(_is_conversation(c) for c in v)


def _non_negative(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    if value is None:
        return 0
    if not is_int(value) or value < 0:
        raise InvalidRequest(f"'{name}' must be a non-negative integer; got {value!r}.", param=name)
    return int(value)
