"""The simulator's answers end where vLLM's would (EOS, ``min_tokens``, a logit bias on EOS), and its engine
preempts and keeps a ``--watermark`` as vLLM V1 does."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.tools.tinymodel import build_tokenizer
from testing.vllm_sim import SimConfig, Simulator, create_sim_app, lognormal_lengths
from testing.vllm_sim.engine import Sequence

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FALLBACK_EOS = "2"  # the stand-in tokenizer's EOS


def make_client(config: SimConfig) -> tuple[httpx.AsyncClient, Simulator]:
    app = create_sim_app(config)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim"), app.state.sim


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    path = build_tokenizer(Path(tmp_path_factory.mktemp("tok")))
    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path))
    return tok


# -- how long an answer is --------------------------------------------------------------------------------

def natural(index: int, max_tokens: int) -> int:
    return 5  # the model draws EOS as its 5th token


@pytest.mark.parametrize(("extra", "completion", "finish"), [
    pytest.param({}, 5, "stop", id="EOS where the model draws it"),
    pytest.param({"min_tokens": 11}, 12, "stop", id="min_tokens masks EOS until then"),
    pytest.param({"min_tokens": 2}, 5, "stop", id="a min_tokens below the natural length changes nothing"),
    pytest.param({"min_tokens": 29, "logit_bias": {FALLBACK_EOS: 100}}, 30, "stop",
                 id="min_tokens L-1 and +100 on EOS end at L"),
    pytest.param({"min_tokens": 0, "logit_bias": {FALLBACK_EOS: 100}}, 1, "stop", id="+100 on EOS ends at once"),
    pytest.param({"min_tokens": 39, "logit_bias": {FALLBACK_EOS: 100}}, 40, "length",
                 id="never past max_tokens"),
    pytest.param({"logit_bias": {FALLBACK_EOS: -100}}, 40, "length", id="-100 on EOS runs to max_tokens"),
    pytest.param({"logit_bias": {"7": 100}}, 5, "stop", id="a bias on another token does not end it"),
    pytest.param({"min_tokens": 29, "logit_bias": {FALLBACK_EOS: 100}, "ignore_eos": True}, 40, "length",
                 id="ignore_eos wins"),
])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_an_answer_ends_where_vllms_sampler_would_end_it(
    path: str, extra: dict[str, Any], completion: int, finish: str
) -> None:
    client, _ = make_client(SimConfig(max_model_len=512, num_blocks=64, stop_early=natural))
    body: dict[str, Any] = {"max_tokens": 40, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"})
    async with client:
        answer = (await client.post(path, json=body)).json()
    assert answer["usage"]["completion_tokens"] == completion
    assert answer["choices"][0]["finish_reason"] == finish


async def test_the_bias_names_the_tokenizers_own_eos(tokenizer: PreTrainedTokenizerBase) -> None:
    client, _ = make_client(SimConfig(tokenizer=tokenizer, max_model_len=512, num_blocks=64))
    eos = str(tokenizer.eos_token_id)
    async with client:
        forced = await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 50, "min_tokens": 9,
                                                      "logit_bias": {eos: 100}})
        other = await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 50, "min_tokens": 9,
                                                     "logit_bias": {str(tokenizer.eos_token_id + 3): 100}})
    assert forced.json()["usage"]["completion_tokens"] == 10
    assert other.json()["usage"]["completion_tokens"] == 50


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "hi", "max_tokens": 10, "min_tokens": 11},
     "min_tokens must be less than or equal to max_tokens=10, got 11."),
    ({"prompt": "hi", "max_tokens": 10, "min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
    # prompt + max_tokens over the context: max_tokens is clamped first, then min_tokens checked against it
    ({"prompt": [5] * 60, "max_tokens": 50, "min_tokens": 10}, "min_tokens must be less than or equal to "
                                                              "max_tokens=4, got 10."),
])
async def test_min_tokens_is_checked_as_vllm_checks_it(body: dict[str, Any], message: str) -> None:
    client, _ = make_client(SimConfig(max_model_len=64, num_blocks=64))
    async with client:
        r = await client.post(COMPLETIONS, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == message


@pytest.mark.parametrize(("bias", "mean"), [
    pytest.param(0.376, 200, id="+0.376 on EOS: a token's chance 1/200"),
    pytest.param(2.694, 30, id="+2.694: 1/30"),
    pytest.param(-100.0, 40, id="-100: never EOS, the max_tokens of 40"),
])
def test_a_moderate_bias_on_eos_ends_answers_geometrically_as_the_tiny_model_does(bias: float, mean: float) -> None:
    sim = Simulator(SimConfig(max_model_len=2048, num_blocks=64, stop_early=natural))
    max_tokens = 40 if bias < 0 else 1024
    lengths = [sim.output_length(i, max_tokens, False, 0, bias) for i in range(4000)]
    assert statistics.fmean(lengths) == pytest.approx(mean, rel=0.06)
    assert lengths[:50] == [sim.output_length(i, max_tokens, False, 0, bias) for i in range(50)]  # a run repeats
    if bias > 0:  # geometric: the median at ln 2 of the mean, whatever the model's own stop_early said
        assert statistics.median(lengths) == pytest.approx(mean * 0.693, rel=0.1)
        assert [sim.output_length(i, 1024, False, 50, bias) for i in range(200)] == [min(1024, 50 + n) for n in
                                                                                    lengths[:200]]  # past min_tokens


def test_lognormal_lengths_repeat_per_seed_and_have_their_mean() -> None:
    draw, again, other = lognormal_lengths(200, 0.8, seed=1), lognormal_lengths(200, 0.8, seed=1), \
        lognormal_lengths(200, 0.8, seed=2)
    lengths = [draw(i, 1024) for i in range(4000)]
    assert lengths[:50] == [again(i, 1024) for i in range(50)]
    assert lengths[:50] != [other(i, 1024) for i in range(50)]
    assert statistics.fmean(lengths) == pytest.approx(200, rel=0.05)
    assert statistics.median(lengths) == pytest.approx(200 * 2.718281828 ** (-0.32), rel=0.05)  # e^(mu)
    assert min(lengths) >= 1


async def test_a_seeded_distribution_gives_each_request_its_own_length() -> None:
    lengths = lognormal_lengths(20, 0.8, seed=3)
    client, _ = make_client(SimConfig(max_model_len=512, num_blocks=64, stop_early=lengths))
    async with client:
        answers = [(await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 400})).json()
                   for _ in range(6)]
    assert [a["usage"]["completion_tokens"] for a in answers] == [min(400, lengths(i, 400)) for i in range(6)]
    assert len({a["usage"]["completion_tokens"] for a in answers}) > 1


# -- preemption and the watermark -------------------------------------------------------------------------

def submit(sim: Simulator, prompt: int, max_tokens: int) -> Sequence:
    return sim.submit(prompt, 1, max_tokens, max_tokens, lambda seq: None)[0]


def run_to_completion(sim: Simulator, seqs: list[Sequence], limit: int = 10_000) -> None:
    for _ in range(limit):
        if all(s.done for s in seqs):
            return
        sim.step()
    raise AssertionError("the engine did not finish")


def preemptions_on_metrics(sim: Simulator) -> float:
    for family in text_string_to_metric_families(sim.metrics_text().decode()):
        for sample in family.samples:
            if sample.name == "vllm:num_preemptions_total":
                return sample.value
    raise AssertionError("no vllm:num_preemptions_total")


def test_the_newest_running_request_is_preempted_to_the_front_of_the_queue_and_counted() -> None:
    sim = Simulator(SimConfig(max_model_len=256, num_blocks=6, block_size=16))
    sim.paused = True  # the test steps the engine itself
    oldest, middle, newest = (submit(sim, 15, 40) for _ in range(3))
    sim.step()
    later = submit(sim, 60, 40)  # waits for 4 blocks, behind the three admitted before it
    while sim.preemptions_total == 0:
        sim.step()
    assert oldest.running and middle.running and not newest.running
    assert sim._waiting[0] is newest and sim._waiting[1] is later
    assert newest.blocks == [] and newest.generated > 0
    assert preemptions_on_metrics(sim) == sim.preemptions_total == 1


@pytest.mark.parametrize(("watermark", "preempted"), [(0.0, True), (0.25, False)])
def test_a_watermark_keeps_blocks_free_for_the_running_and_spares_their_preemption(
    watermark: float, preempted: bool
) -> None:
    # Each request grows from 1 block to ceil((15 + 48) / 16) = 4: three fill the 12 blocks at their end. A 4th
    # admitted beside them forces a preemption; a watermark of 3 blocks holds it back (1 + 3 > 3 free).
    sim = Simulator(SimConfig(max_model_len=256, num_blocks=12, block_size=16, watermark=watermark))
    sim.paused = True
    seqs = [submit(sim, 15, 49) for _ in range(3)]
    for _ in range(20):
        sim.step()  # 34 tokens each: 3 blocks each, 3 free
    seqs.append(submit(sim, 15, 49))
    run_to_completion(sim, seqs)
    assert (sim.preemptions_total > 0) is preempted
    assert all(s.generated == 49 for s in seqs)
    assert sim.used_blocks == 0


def test_the_watermark_never_holds_back_a_request_with_nothing_running() -> None:
    sim = Simulator(SimConfig(max_model_len=256, num_blocks=4, block_size=16, watermark=0.5))
    sim.paused = True
    seq = submit(sim, 40, 8)  # 3 blocks of 4, past the watermark's 2 free, but nothing else runs
    sim.step()
    assert seq.running
