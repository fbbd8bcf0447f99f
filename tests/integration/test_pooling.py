"""The pooling routes through the guard: every input counted as the engine counts it, held to the context,
booked as prompt blocks only — against the vLLM simulator, plus the pieces that need no server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.config import Settings
from gateway.errors import ContextLengthExceeded, InvalidRequest, KVBudgetExceeded
from gateway.guard.counting import LocalCounter
from gateway.guard.endpoints.pooling import Chats, Pairs, Texts, fit_context
from gateway.guard.endpoints.table import BY_NAME
from gateway.guard.planning import batch_sequences
from gateway.guard.policy import Limits
from testing.gateway_thread import GatewayServer, run_gateway
from testing.vllm_sim import SimConfig, SimServer, run_sim_server

MAX_MODEL_LEN = 256
CHAT = [{"role": "system", "content": "Embed this."}, {"role": "user", "content": "A sentence about cats."}]

# (id, path, body, prompts): every input shape of every pooling route.
CASES: list[tuple[str, str, dict[str, Any], int]] = [
    ("embeddings of a string", "/v1/embeddings", {"input": "The quick brown fox"}, 1),
    ("embeddings of strings", "/v1/embeddings", {"input": ["alpha beta", "gamma", "delta epsilon zeta"]}, 3),
    ("embeddings of token ids", "/v1/embeddings", {"input": [5, 6, 7, 8, 9]}, 1),
    ("embeddings of token id lists", "/v1/embeddings", {"input": [[5, 6], [7, 8, 9]]}, 2),
    ("embeddings without special tokens", "/v1/embeddings", {"input": "no bos", "add_special_tokens": False}, 1),
    ("embeddings of a conversation", "/v1/embeddings", {"messages": CHAT}, 1),
    ("embeddings of a batch of conversations", "/v1/embeddings", {"messages": [CHAT, CHAT[1:]]}, 2),
    ("embeddings of a conversation in input", "/v1/embeddings", {"input": CHAT}, 1),
    ("embeddings of a conversation with a generation prompt", "/v1/embeddings",
     {"messages": CHAT, "add_generation_prompt": True}, 1),
    ("embeddings truncated by the client", "/v1/embeddings",
     {"input": ["word " * 100, "short"], "truncate_prompt_tokens": 20}, 2),
    ("embeddings truncated to the context", "/v1/embeddings",
     {"input": "word " * 400, "truncate_prompt_tokens": -1}, 1),
    ("pooling of strings", "/pooling", {"input": ["one two", "three"]}, 2),
    ("pooling of a conversation", "/pooling", {"messages": CHAT}, 1),
    ("classification of strings", "/classify", {"input": ["good movie", "bad movie"]}, 2),
    ("classification of a conversation", "/classify", {"messages": CHAT}, 1),
    ("score 1:N", "/score", {"text_1": "What is a cat?", "text_2": ["A cat is a small animal.", "Dogs bark."]}, 2),
    ("score N:N", "/v1/score", {"text_1": ["q one", "q two"], "text_2": ["doc one here", "doc two"]}, 2),
    ("score 1:1", "/score", {"text_1": "query", "text_2": "document"}, 1),
    ("score of queries and documents", "/score", {"queries": "query", "documents": ["d1 a", "d2 b c"]}, 2),
    ("score with bounded texts", "/score",
     {"text_1": "a long query " * 10, "text_2": ["a long document " * 20], "max_tokens_per_query": 5,
      "max_tokens_per_doc": 9}, 1),
    ("rerank", "/rerank", {"query": "best pet?", "documents": ["cats", "dogs are loyal", "fish"]}, 3),
    ("rerank v1 with top_n", "/v1/rerank", {"query": "q", "documents": ["a", "b c"], "top_n": 1}, 2),
    ("rerank v2", "/v2/rerank", {"query": "q", "documents": "just one"}, 1),
]


# -- parsing --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("route", "body", "kind", "params"),
    [
        ("embeddings", {"input": "x"}, Texts, ["input"]),
        ("embeddings", {"input": ["x", "y"]}, Texts, ["input[0]", "input[1]"]),
        ("embeddings", {"input": [1, 2, 3]}, Texts, ["input"]),
        ("embeddings", {"input": [[1], [2, 3]]}, Texts, ["input[0]", "input[1]"]),
        ("embeddings", {"messages": CHAT}, Chats, ["messages"]),
        ("embeddings", {"messages": [CHAT, CHAT]}, Chats, ["messages[0]", "messages[1]"]),
        ("embeddings", {"input": [CHAT, CHAT]}, Chats, ["input[0]", "input[1]"]),
        ("classify", {"messages": CHAT}, Chats, ["messages"]),
        ("score", {"data_1": "q", "data_2": ["a", "b"]}, Pairs, ["data_2[0]", "data_2[1]"]),
        ("score", {"queries": "q", "items": "a"}, Pairs, ["items"]),
        ("rerank", {"query": "q", "documents": ["a", "b"]}, Pairs, ["documents[0]", "documents[1]"]),
    ],
    ids=lambda v: None,
)
def test_each_route_reads_its_inputs_as_one_prompt_each(
    route: str, body: dict[str, Any], kind: type, params: list[str]
) -> None:
    req = BY_NAME[route].parse(body)
    assert isinstance(req.inputs, kind)
    assert req.params == params


def test_a_pooling_conversation_gets_vllms_pooling_defaults() -> None:
    req = BY_NAME["embeddings"].parse({"messages": CHAT})
    assert isinstance(req.inputs, Chats)
    assert req.inputs.bodies[0] == {
        "messages": CHAT, "add_generation_prompt": False, "continue_final_message": False, "add_special_tokens": False
    }


def test_one_query_pairs_with_every_document() -> None:
    req = BY_NAME["rerank"].parse({"query": "q", "documents": ["a", "b"], "max_tokens_per_doc": 3})
    assert req.inputs == Pairs([("q", "a"), ("q", "b")], 0, 3)


@pytest.mark.parametrize(
    ("route", "body", "param", "words"),
    [
        ("embeddings", {}, "input", "must be a string"),
        ("embeddings", {"input": []}, "input", "an empty list"),
        ("embeddings", {"input": ["a", 1]}, "input", "must be a string"),
        ("embeddings", {"input": "x", "messages": CHAT}, "messages", "either"),
        ("classify", {"messages": [CHAT, CHAT]}, "messages", "chat messages"),
        ("embeddings", {"input": "x", "add_special_tokens": "yes"}, "add_special_tokens", "boolean"),
        ("embeddings", {"input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "at least -1"),
        ("embeddings", {"input": "x", "padding": "longest"}, "padding", "'max_length'"),
        ("pooling", {"data": {"image": "..."}}, "data", "plugin"),
        ("score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "1:N or N:N"),
        ("score", {"text_1": "a", "text_2": []}, "text_2", "empty"),
        ("score", {"text_1": "a", "text_2": [{"content": [{"type": "image_url"}]}]}, "text_2[0]", "multimodal"),
        ("score", {"model": "tiny"}, "text_1", "needs"),
        ("rerank", {"query": ["a"], "documents": ["b"]}, "query", "one string"),
        ("rerank", {"query": "a", "documents": ["b"], "max_tokens_per_doc": -1}, "max_tokens_per_doc", "non-negative"),
    ],
    ids=lambda v: None,
)
def test_malformed_or_uncountable_inputs_are_refused(route: str, body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        BY_NAME[route].parse(body)
    assert info.value.param == param
    assert words in info.value.message


# -- counting and the context ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("first", "second"),
    [("What is a cat?", "A cat is a small animal."), ("", "only the second"), ("héllo  wörld", "\n\ttabs\n"),
     ("same", "same")],
)
async def test_a_pair_counts_as_the_tokenizer_encodes_it(tokenizer: Any, first: str, second: str) -> None:
    counter = LocalCounter(tokenizer)
    [count] = await counter.count_pairs([(first, second)])
    assert count == len(tokenizer(first, text_pair=second)["input_ids"])


async def test_pair_bounds_cut_each_side_before_joining(tokenizer: Any) -> None:
    counter = LocalCounter(tokenizer)
    [count] = await counter.count_pairs([("one two three four five", "six seven eight")], max_first=2, max_second=1)
    assert count == 2 + 1 + tokenizer.num_special_tokens_to_add(pair=True)


@pytest.mark.parametrize(
    ("body", "counts", "policy", "lengths", "cut"),
    [
        ({"input": ["a", "b"]}, [10, 20], "reject", [10, 20], 0),
        ({"input": ["a", "b"], "truncate_prompt_tokens": 15}, [10, 20], "reject", [10, 15], 0),
        ({"input": "a", "truncate_prompt_tokens": -1}, [300], "reject", [100], 0),
        ({"input": "a", "padding": "max_length"}, [10], "reject", [100], 0),
        ({"input": ["a", "b"]}, [10, 150], "truncate", [10, 100], 50),
    ],
    ids=["fits", "truncated by the client", "truncated to the context", "padded to the context",
         "truncated by the policy"],
)
def test_prompt_lengths_follow_the_engines_truncation_and_padding(
    body: dict[str, Any], counts: list[int], policy: Any, lengths: list[int], cut: int
) -> None:
    req = BY_NAME["embeddings"].parse(body)
    # The engine is asked to cut at the context only where the policy cut; the client's body stays as it came.
    assert fit_context(req, counts, Limits(100), policy, 100) == (lengths, cut, 100 if cut else None)
    assert req.body == body


@pytest.mark.parametrize(
    ("limits", "words"),
    [(Limits(100), "maximum context length is 100 tokens; input[1] uses 150 tokens"),
     (Limits(100, max_prompt_tokens=50), "at most 50 tokens")],
    ids=["the context", "--max-prompt-tokens"],
)
def test_a_prompt_over_the_limit_is_rejected_with_where_it_is(limits: Limits, words: str) -> None:
    req = BY_NAME["embeddings"].parse({"input": ["a", "b"]})
    with pytest.raises(ContextLengthExceeded) as info:
        fit_context(req, [10, 150], limits, "reject", 100)
    assert info.value.param == "input[1]"
    assert words in info.value.message


def test_truncation_beyond_the_engines_context_is_refused() -> None:
    req = BY_NAME["embeddings"].parse({"input": "a", "truncate_prompt_tokens": 500})
    with pytest.raises(InvalidRequest, match="cannot be greater than max_model_len=100"):
        fit_context(req, [10], Limits(100), "reject", 100)


class BudgetOf:
    """Admission's fit() for a KV budget of ``blocks`` blocks of 16 tokens."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks

    def fit(self, prompt_tokens: int, max_tokens: int, n: int, *, clamp: bool) -> int:
        if n * -(-(prompt_tokens + max_tokens) // 16) > self.blocks:
            raise KVBudgetExceeded("too large")
        return max_tokens


@pytest.mark.parametrize(
    ("prompt_tokens", "n", "blocks", "booked"),
    [(20, 10, 100, 10), (20, 10, 9, 4), (20, 1000, 7, 3), (16, 3, 3, 3)],
    ids=["a batch that fits is booked whole", "a larger batch books what the budget holds",
         "a huge batch too", "exactly full"],
)
def test_a_batch_books_as_many_prompts_as_the_budget_holds(
    prompt_tokens: int, n: int, blocks: int, booked: int
) -> None:
    assert batch_sequences(BudgetOf(blocks), prompt_tokens, n) == booked  # type: ignore[arg-type]


def test_a_single_prompt_larger_than_the_budget_is_refused() -> None:
    with pytest.raises(KVBudgetExceeded):
        batch_sequences(BudgetOf(1), 40, 5)  # type: ignore[arg-type]


# -- through the gateway --------------------------------------------------------------------------------
def sim_config(tokenizer: Any, tokenizer_dir: Any, **kw: Any) -> SimConfig:
    return SimConfig(model="tiny", root=str(tokenizer_dir), max_model_len=MAX_MODEL_LEN, block_size=16,
                     tokenizer=tokenizer, **{"num_blocks": 256, **kw})


@pytest.fixture
def sim(tokenizer: Any, tokenizer_dir: Any) -> Iterator[SimServer]:
    with run_sim_server(sim_config(tokenizer, tokenizer_dir)) as server:
        yield server


@pytest.fixture
def gateway(sim: SimServer, base_settings: Settings) -> Iterator[GatewayServer]:
    with run_gateway(base_settings, upstream=sim.url) as gw:
        yield gw


@pytest.mark.parametrize(("case", "path", "body", "prompts"), CASES, ids=[c for c, *_ in CASES])
def test_every_input_is_counted_as_the_engine_counts_it(
    gateway: GatewayServer, case: str, path: str, body: dict[str, Any], prompts: int
) -> None:
    answer = httpx.post(gateway.url + path, json={"model": "tiny", **body}, timeout=10)
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert int(answer.headers["x-guard-prompt-tokens"]) == result["usage"]["prompt_tokens"], case
    assert answer.headers["x-guard-max-tokens"] == "0"
    assert len(result.get("data") or result.get("results")) == (1 if "top_n" in body else prompts)
    gateway.wait_ledger_empty()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"input": ["short", "word " * 300]}, "input[1]"),
        ("/v1/embeddings", {"messages": [{"role": "user", "content": "word " * 300}]}, "messages"),
        ("/pooling", {"input": [5] * (MAX_MODEL_LEN + 1)}, "input"),
        ("/classify", {"input": "word " * 300}, "input"),
        ("/score", {"text_1": "q", "text_2": ["d", "word " * 300]}, "text_2[1]"),
        ("/rerank", {"query": "word " * 200, "documents": ["word " * 100]}, "documents[0]"),
    ],
    ids=["embeddings", "embeddings chat", "pooling token ids", "classify", "score", "rerank"],
)
def test_a_prompt_over_the_context_never_reaches_the_engine(
    gateway: GatewayServer, sim: SimServer, path: str, body: dict[str, Any], param: str
) -> None:
    answer = httpx.post(gateway.url + path, json={"model": "tiny", **body}, timeout=10)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert not sim.sim.requests_seen
    gateway.wait_ledger_empty()


def test_the_truncate_policy_has_the_engine_cut_each_prompt_to_the_context(
    gateway: GatewayServer, sim: SimServer
) -> None:
    answer = httpx.post(gateway.url + "/v1/embeddings", json={"input": ["short", "word " * 300]},
                        headers={"x-guard-on-overflow": "truncate"}, timeout=10)
    assert answer.status_code == 200
    assert sim.sim.requests_seen[-1]["truncate_prompt_tokens"] == MAX_MODEL_LEN
    assert int(answer.headers["x-guard-prompt-tokens"]) == answer.json()["usage"]["prompt_tokens"]
    assert int(answer.headers["x-guard-truncated-tokens"]) > 0


def test_a_batch_larger_than_the_kv_budget_runs_alone_and_a_prompt_larger_than_it_is_refused(
    tokenizer: Any, tokenizer_dir: Any, base_settings: Settings
) -> None:
    # 8 blocks of 16 tokens: room for 128 tokens at once, while the context is 256.
    with run_sim_server(sim_config(tokenizer, tokenizer_dir, num_blocks=8)) as sim, \
            run_gateway(base_settings, upstream=sim.url) as gw:
        batch = httpx.post(gw.url + "/v1/embeddings", json={"input": ["word " * 20] * 30}, timeout=10)
        assert batch.status_code == 200
        assert int(batch.headers["x-guard-prompt-tokens"]) == batch.json()["usage"]["prompt_tokens"]
        huge = httpx.post(gw.url + "/v1/embeddings", json={"input": [5] * 200}, timeout=10)
        assert huge.status_code == 400 and huge.json()["error"]["code"] == "kv_budget_exceeded"
        gw.wait_ledger_empty()


def test_pooling_requests_never_teach_admission_how_long_outputs_are(gateway: GatewayServer) -> None:
    for _ in range(10):
        assert httpx.post(gateway.url + "/v1/embeddings", json={"input": "x"}, timeout=10).status_code == 200
    assert gateway.status()["output_lengths"] == {}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [("/pooling", {"data": {"prompt": "x"}}, "data"),
     ("/rerank", {"query": "q", "documents": [{"content": [{"type": "text", "text": "d"}]}]}, "documents[0]")],
    ids=["plugin data", "multimodal documents"],
)
def test_inputs_only_the_engine_could_count_are_refused(
    gateway: GatewayServer, sim: SimServer, path: str, body: dict[str, Any], param: str
) -> None:
    answer = httpx.post(gateway.url + path, json=body, timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    assert not sim.sim.requests_seen
