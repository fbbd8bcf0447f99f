"""The engine's figures of a stream's output, and the stream as its client asked for it: vLLM is asked for
usage on every chunk, the count comes from there (not from the number of events), and the client gets the bytes
vLLM would have sent it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine.usage import EVERYTHING, Fingerprint, StreamUsage, UsageAsk, ask_engine_for_usage

HEAD = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny"'
CHEAD = b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"tiny"'
FP = "vllm-0.32.0-abcd1234"


def usage(prompt: int, completion: int) -> bytes:
    return orjson.dumps({"prompt_tokens": prompt, "total_tokens": prompt + completion,
                         "completion_tokens": completion})


def chat(index: int, content: str, done: int | None, finish: str | None = None, *, role: bool = False,
         fingerprint: str | None = None) -> bytes:
    """A chat chunk as vLLM 0.32 writes it; ``done``: the choice's running count (continuous usage) or None."""
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    out = HEAD + b',"choices":[' + orjson.dumps(choice) + b"]"
    if done is not None:
        out += b',"usage":' + usage(5, done)
    if fingerprint is not None:
        out += b',"system_fingerprint":' + orjson.dumps(fingerprint)
    if role:
        out += b',"prompt_token_ids":null,"prompt_text":null'
    return out + b"}\n\n"


def final(completion: int, fingerprint: str | None = FP) -> bytes:
    fp = b',"system_fingerprint":' + orjson.dumps(fingerprint) if fingerprint else b""
    return HEAD + b',"choices":[],"usage":' + usage(5, completion) + fp + b"}\n\n"


def completion(index: int, text: str, done: int | None, finish: str | None = None) -> bytes:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    out = CHEAD + b',"choices":[' + orjson.dumps(choice) + b"]"
    if done is not None:
        out += b',"usage":' + usage(3, done)
    return out + b"}\n\n"


DONE = b"data: [DONE]\n\n"


def engine_stream(n: int, steps: list[int], *, fingerprint: str | None = FP) -> list[bytes]:
    """What vLLM sends when asked for usage on every chunk: ``steps`` tokens per event for each of ``n``
    choices, then the usage chunk and [DONE]."""
    events = [chat(i, "", 0, role=True) for i in range(n)]
    for i in range(n):
        done = 0
        for k, step in enumerate(steps):
            done += step
            events.append(chat(i, "x" * step, done, "length" if k == len(steps) - 1 else None))
    return [*events, final(n * sum(steps), fingerprint), DONE]


def client_stream(n: int, steps: list[int], ask: UsageAsk, *, fingerprint: str | None = FP) -> list[bytes]:
    """What vLLM sends a client that asked ``ask`` (the same stream, without what was not asked)."""
    cont = ask.continuous
    events = [chat(i, "", 0 if cont else None, role=True) for i in range(n)]
    for i in range(n):
        done = 0
        for k, step in enumerate(steps):
            done += step
            last = k == len(steps) - 1
            stamp = fingerprint if last and not ask.final else None
            events.append(chat(i, "x" * step, done if cont else None, "length" if last else None,
                               fingerprint=stamp))
    tail = [final(n * sum(steps), fingerprint)] if ask.final else []
    return [*events, *tail, DONE]


def relay(
    events: list[bytes], ask: UsageAsk, route: str = "chat", reads: int = 1, known: Fingerprint | None = None
) -> tuple[list[bytes], StreamUsage]:
    meter = StreamUsage(route, ask, known)
    out: list[bytes] = []
    size = max(1, len(events) // reads)
    for i in range(0, len(events), size):
        out += meter.feed(events[i : i + size])
    return out + meter.close(), meter


@dataclass(frozen=True)
class Asked:
    id: str
    options: Any
    ask: UsageAsk
    sent: Any  # the stream_options the engine gets


EVERY_CHUNK = {"include_usage": True, "continuous_usage_stats": True}
ASKS = [
    Asked("no options", None, UsageAsk(False, False), {"include_usage": True, "continuous_usage_stats": True}),
    Asked("usage asked", {"include_usage": True}, UsageAsk(True, False),
          {"include_usage": True, "continuous_usage_stats": True}),
    Asked("continuous asked", {"include_usage": True, "continuous_usage_stats": True}, EVERYTHING,
          {"include_usage": True, "continuous_usage_stats": True}),
    Asked("continuous without usage (vLLM sends none)", {"continuous_usage_stats": True}, UsageAsk(False, False),
          {"include_usage": True, "continuous_usage_stats": True}),
    Asked("usage declined", {"include_usage": False}, UsageAsk(False, False),
          {"include_usage": True, "continuous_usage_stats": True}),
    Asked("other options kept", {"x": 1}, UsageAsk(False, False),
          {"x": 1, "include_usage": True, "continuous_usage_stats": True}),
    # Values that are not JSON booleans, read as vLLM's pydantic model reads them (``test_vllm_reading``).
    Asked("0 declines usage", {"include_usage": 0}, UsageAsk(False, False), EVERY_CHUNK),
    Asked('"false" declines usage', {"include_usage": "false"}, UsageAsk(False, False), EVERY_CHUNK),
    Asked('"no" declines usage', {"include_usage": "no"}, UsageAsk(False, False), EVERY_CHUNK),
    Asked("null declines usage", {"include_usage": None}, UsageAsk(False, False), EVERY_CHUNK),
    Asked("continuous 1 without usage asks nothing", {"continuous_usage_stats": 1}, UsageAsk(False, False),
          EVERY_CHUNK),
    Asked("1 asks for usage", {"include_usage": 1}, UsageAsk(True, False), EVERY_CHUNK),
    Asked('"yes" and "off"', {"include_usage": "yes", "continuous_usage_stats": "off"}, UsageAsk(True, False),
          EVERY_CHUNK),
    Asked('"on" and "t" ask everything: sent as they are', {"include_usage": "on", "continuous_usage_stats": "t"},
          EVERYTHING, {"include_usage": "on", "continuous_usage_stats": "t"}),
    Asked("a value vLLM refuses is sent as it is (its own 400)", {"include_usage": "maybe"}, EVERYTHING,
          {"include_usage": "maybe"}),
    Asked("a list vLLM refuses is sent as it is", {"continuous_usage_stats": [1]}, EVERYTHING,
          {"continuous_usage_stats": [1]}),
]


class TestWhatTheEngineIsAsked:
    @pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in ASKS])
    def test_every_stream_asks_for_usage_on_every_chunk_and_remembers_what_the_client_asked(self, case: Asked) -> None:
        body: dict[str, Any] = {"model": "tiny", "stream": True}
        if case.options is not None:
            body["stream_options"] = case.options
        sent, ask = ask_engine_for_usage(body)
        assert ask == case.ask
        assert sent["stream_options"] == case.sent
        assert body.get("stream_options") == case.options  # the client's body is not changed in place

    @pytest.mark.parametrize("fields,choices", [
        ({}, 1), ({"n": 3}, 3), ({"n": None}, 1), ({"prompt": "one"}, 1), ({"prompt": [1, 2, 3], "n": 2}, 2),
        ({"prompt": ["a", "b"], "n": 2}, 4), ({"prompt": [[1], [2], [3]]}, 3),
    ], ids=["one", "n=3", "n null", "one prompt", "token ids are one prompt", "two prompts, n=2", "three id lists"])
    def test_the_choices_are_counted_as_vllm_numbers_them(self, fields: dict[str, Any], choices: int) -> None:
        _, ask = ask_engine_for_usage({"model": "tiny", "stream": True, **fields})
        assert ask.choices == choices


@pytest.mark.parametrize("ask", [UsageAsk(False, False), UsageAsk(True, False), EVERYTHING],
                         ids=["nothing asked", "usage asked", "continuous asked"])
@pytest.mark.parametrize("n,steps", [(1, [1, 1, 1]), (1, [1, 1000, 599]), (3, [1, 400, 100]), (2, [1])],
                         ids=["one token a step", "stream_interval 1000", "n=3 with an interval", "n=2 one token"])
@pytest.mark.parametrize("reads", [1, 3], ids=["one read", "three reads"])
def test_the_client_gets_what_vllm_would_have_sent_it_and_the_count_is_the_engines(
    ask: UsageAsk, n: int, steps: list[int], reads: int
) -> None:
    out, meter = relay(engine_stream(n, steps), replace(ask, choices=n), reads=reads, known=learned())
    assert out == client_stream(n, steps, ask)
    assert meter.generated == n * sum(steps) and meter.reported


def interleaved(lengths: list[int], ask: UsageAsk | None, *, fingerprint: str | None = FP) -> list[bytes]:
    """A stream of one choice per entry of ``lengths``, one token a step, in vLLM's order: every choice's role
    chunk, then each step's token of every choice still running, the shortest ending first. ``ask`` None: what
    the engine sends when asked for everything; else what it sends a client that asked ``ask``."""
    cont = ask is None or ask.continuous
    final_asked = ask is None or ask.final
    events = [chat(i, "", 0 if cont else None, role=True) for i in range(len(lengths))]
    for step in range(1, max(lengths) + 1):
        for i, length in enumerate(lengths):
            if step <= length:
                last = step == length
                stamp = fingerprint if last and not final_asked else None
                events.append(chat(i, "x", step if cont else None, "stop" if last else None, fingerprint=stamp))
    tail = [final(sum(lengths), fingerprint)] if final_asked else []
    return [*events, *tail, DONE]


def learned(fingerprint: str | None = FP) -> Fingerprint:
    """An engine's fingerprint as one earlier stream taught it."""
    known = Fingerprint()
    relay_learning(interleaved([1], None, fingerprint=fingerprint), UsageAsk(False, False), known)
    return known


def relay_learning(events: list[bytes], ask: UsageAsk, known: Fingerprint) -> list[list[bytes]]:
    """What the relay gives back for each event fed alone, in order."""
    meter = StreamUsage("chat", ask, known)
    return [meter.feed([event]) for event in events] + [meter.close()]


class TestMultiChoiceStreamsInVllmsOrder:
    @pytest.mark.parametrize("fingerprint", [FP, None], ids=["a fingerprint", "none stamped (mode none)"])
    @pytest.mark.parametrize("ask", [UsageAsk(False, False), UsageAsk(True, False)],
                             ids=["nothing asked", "usage asked"])
    def test_each_choice_ends_as_the_engine_ends_it_once_the_fingerprint_is_known(
        self, ask: UsageAsk, fingerprint: str | None
    ) -> None:
        lengths = [2, 5, 3]
        engine, client = interleaved(lengths, None, fingerprint=fingerprint), interleaved(
            lengths, ask, fingerprint=fingerprint)
        outs = relay_learning(engine, ask, learned(fingerprint))
        assert [e for out in outs for e in out] == client  # byte for byte, in vLLM's order
        # Nothing waits: every chunk but the untold usage chunk comes out as it comes in.
        assert all(len(out) == 1 for out, event in zip(outs, engine, strict=False) if b'"choices":[]' not in event)

    def test_before_the_fingerprint_is_known_no_end_waits_behind_another_choices_text(self) -> None:
        """The first stream an engine serves: each end goes as it comes while other choices still run (without
        the fingerprint, not yet told); the last choice's end waits only for the usage chunk vLLM writes right
        behind it, and is stamped from there."""
        known, lengths, ask = Fingerprint(), [2, 5, 3], UsageAsk(False, False, choices=3)
        engine = interleaved(lengths, None)
        outs = relay_learning(engine, ask, known)
        last_end = next(k for k, e in enumerate(engine) if b'"index":1,' in e and b'"finish_reason":"' in e)
        usage_chunk = engine.index(final(sum(lengths)))
        for k, out in enumerate(outs[: len(engine)]):
            if k == last_end:
                assert out == []
            elif k == usage_chunk:
                assert out == [chat(1, "x", None, "stop", fingerprint=FP)]
            else:
                assert len(out) == 1, f"event {k} was held"
        unstamped = [e.replace(b',"system_fingerprint":' + orjson.dumps(FP), b"")
                     if b'"index":1,' not in e else e for e in interleaved(lengths, ask)]
        assert [e for out in outs for e in out] == unstamped  # vLLM's order, every choice's end where it was
        assert known.known and known.value == FP
        second = [e for out in relay_learning(interleaved(lengths, None), ask, known) for e in out]
        assert second == interleaved(lengths, ask)  # once learned, every end is stamped as it passes

    def test_ends_read_with_the_usage_chunk_are_all_stamped_before_the_fingerprint_is_known(self) -> None:
        lengths, ask = [3, 3], UsageAsk(False, False, choices=2)
        out, _ = relay(interleaved(lengths, None), ask, known=Fingerprint())
        assert out == interleaved(lengths, ask)

    def test_an_end_held_for_the_usage_chunk_goes_before_any_other_chunk(self) -> None:
        """Choices miscounted (or an engine that sends no usage): a held end still never waits behind text."""
        meter = StreamUsage("chat", UsageAsk(False, False, choices=1), Fingerprint())
        end = chat(0, "x", 1, "stop")
        assert meter.feed([end]) == []
        assert meter.feed([chat(1, "y", 1)]) == [chat(0, "x", None, "stop"), chat(1, "y", None)]
        assert meter.feed([chat(1, "z", 2, "stop")]) == []
        assert meter.feed([DONE]) == [chat(1, "z", None, "stop"), DONE]

    def test_a_new_fingerprint_is_learned_from_the_next_usage_chunk(self) -> None:
        known = learned("vllm-0.32.0-old")
        relay_learning(interleaved([1], None, fingerprint="vllm-0.33.0-new"), UsageAsk(False, False), known)
        assert known.value == "vllm-0.33.0-new"
        relay_learning(interleaved([1], None, fingerprint=None), UsageAsk(True, True), known)
        assert known.known and known.value is None

    def test_a_chunk_the_engine_stamped_itself_is_not_stamped_again(self) -> None:
        stamped = chat(0, "x", None, "stop", fingerprint=FP)
        assert StreamUsage("chat", UsageAsk(False, False), learned()).feed([stamped]) == [stamped]


def test_one_event_of_many_tokens_counts_all_of_them_as_it_arrives() -> None:
    meter = StreamUsage("chat", UsageAsk(False, False))
    meter.feed([chat(0, "", 0, role=True), chat(0, "a", 1)])
    assert meter.generated == 1
    meter.feed([chat(0, "b" * 1000, 1001)])
    assert meter.generated == 1001 and not meter.reported


def test_a_fingerprint_waits_only_for_the_usage_chunk_and_no_fingerprint_stamps_nothing() -> None:
    ask = UsageAsk(False, False)
    out, _ = relay(engine_stream(1, [1, 2], fingerprint=None), ask)
    assert out == client_stream(1, [1, 2], ask, fingerprint=None)
    meter = StreamUsage("chat", ask)
    assert meter.feed([chat(0, "x", 1, "stop")]) == []  # held for the fingerprint the usage chunk tells
    assert meter.feed([final(1)]) == [chat(0, "x", None, "stop", fingerprint=FP)]


def test_a_stream_that_breaks_before_its_usage_chunk_gives_back_what_was_held() -> None:
    meter = StreamUsage("chat", UsageAsk(False, False))
    assert meter.feed([chat(0, "x", 1, "stop")]) == []
    assert meter.close() == [chat(0, "x", None, "stop")]
    assert meter.generated == 1 and not meter.reported


def test_completions_with_several_prompts_sum_every_choice() -> None:
    events = [completion(0, "a", 1), completion(1, "bb", 2), completion(0, "c" * 10, 11, "length"),
              completion(1, "d", 3, "stop")]
    meter = StreamUsage("completions", EVERYTHING)
    assert meter.feed(events) == events
    assert meter.generated == 14


def test_a_chunk_written_otherwise_than_vllm_writes_it_is_still_read_and_cleaned() -> None:
    spaced = b'data: {"id": "c", "choices": [{"index": 0, "text": "ab", "finish_reason": null}], ' \
             b'"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}\n\n'
    meter = StreamUsage("completions", UsageAsk(True, False))
    (out,) = meter.feed([spaced])
    assert meter.generated == 2
    assert orjson.loads(out[6:]) == {"id": "c", "choices": [{"index": 0, "text": "ab", "finish_reason": None}]}


def test_an_engine_that_reports_nothing_is_counted_one_token_per_event() -> None:
    events = [chat(0, "", None, role=True), chat(0, "a", None), chat(0, "b", None, "stop"), DONE]
    out, meter = relay(events, EVERYTHING)
    assert out == events and meter.generated == 2 and not meter.reported


def responses_event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def test_responses_count_deltas_until_the_closing_event_tells_the_engines_figure() -> None:
    deltas = [responses_event("response.output_text.delta", {"delta": "x" * 50}) for _ in range(3)]
    closing = responses_event("response.completed", {"response": {"usage": {"output_tokens": 150}}})
    meter = StreamUsage("responses", EVERYTHING)
    assert meter.feed(deltas) == deltas
    assert meter.generated == 3 and not meter.reported  # a lower bound: an event may carry many tokens
    assert meter.feed([closing]) == [closing]
    assert meter.generated == 150 and meter.reported


# -- the bytes-only read of a running chunk stands in for the parse ------------------------------------
_USAGE_FIELDS = st.fixed_dictionaries(
    {"prompt_tokens": st.integers(0, 10**6), "completion_tokens": st.integers(0, 10**6)},
    optional={"total_tokens": st.integers(0, 10**6), "prompt_tokens_details": st.one_of(
        st.none(), st.fixed_dictionaries({"cached_tokens": st.integers(0, 100)}))},
)


@st.composite
def running_chunks(draw: st.DrawFn) -> bytes:
    """Running chunks of vLLM's shape and near it: fields in any order, details nested or not, another spacing,
    a usage that is not the chunk's last field, a choice's end."""
    fields = draw(_USAGE_FIELDS)
    order = draw(st.permutations(list(fields)))
    spaced = draw(st.booleans())
    usage_bytes = orjson.dumps({k: fields[k] for k in order})
    if spaced:
        usage_bytes = usage_bytes.replace(b":", b": ")
    finish = draw(st.sampled_from([None, "stop", "length"]))
    choice = {"index": draw(st.integers(0, 12)), "delta": {"content": draw(st.text(max_size=8))}, "logprobs": None,
              "finish_reason": finish}
    tail = draw(st.sampled_from([b"", b',"prompt_token_ids":null,"prompt_text":null']))
    return HEAD + b',"choices":[' + orjson.dumps(choice) + b'],"usage":' + usage_bytes + tail + b"}\n\n"


class ParsedOnly(StreamUsage):
    """Every chunk through the parse."""

    def _fast(self, event: bytes) -> bytes | None:
        return None


@given(events=st.lists(running_chunks(), min_size=1, max_size=6), ask=st.sampled_from([
    UsageAsk(final=False, continuous=False, choices=3), UsageAsk(final=True, continuous=False, choices=3),
    UsageAsk(final=False, continuous=True, choices=3), EVERYTHING,
]))
@settings(max_examples=300, deadline=None)
def test_a_running_chunk_read_with_bytes_alone_is_relayed_and_counted_as_the_parse_does(
    events: list[bytes], ask: UsageAsk
) -> None:
    fast, parsed = StreamUsage("chat", ask, Fingerprint()), ParsedOnly("chat", ask, Fingerprint())
    assert fast.feed(events) + fast.close() == parsed.feed(events) + parsed.close()
    assert (fast.generated, fast.reported) == (parsed.generated, parsed.reported)
