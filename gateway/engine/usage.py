"""What a stream generated, by the engine's own count, and the stream as its client asked for it.

vLLM sends one event per engine step and request, not one per token: with ``stream_interval`` (the request's,
or the server's ``--stream-interval``) or speculative decoding an event carries many tokens, so counting events
undercounts (one event of 1,000 tokens). The gateway therefore asks vLLM for usage on every chat and
completions stream (``stream_options.include_usage`` and ``continuous_usage_stats``: each chunk then carries its
choice's running count, a last chunk the total) and takes its figures from there. The client's own options are
read as vLLM reads them (``vllm_api.reading``: ``"include_usage": 0``, ``"no"`` or ``"false"`` ask nothing, ``"yes"``
asks), and what it did not ask for is taken out of the relayed stream, so that it receives the bytes vLLM would
have sent it, in vLLM's order:

- the per-chunk ``usage`` field, unless the client asked for ``continuous_usage_stats``;
- the final usage-only chunk, unless it asked for ``include_usage``. vLLM then stamps ``system_fingerprint`` on
  each choice's last chunk instead (it does not when usage follows). The fingerprint is the server's constant
  (``--fingerprint-mode``: ``vllm-<version>[-<parallelism>]-<config hash>``, a custom value, or none at all,
  vllm/entrypoints/serve/utils/fingerprint.py), computed once at start-up; every usage chunk tells it, so it
  is learned once per engine (``Fingerprint``) and stamped on each choice's end as it passes, in the order vLLM
  sends them. An end is never held behind another choice's text: until the fingerprint is first learned, only
  the last choice's end waits, for the usage chunk vLLM writes right behind it (no engine step between them);
  an end while other choices still run goes at once, unstamped (the one difference from vLLM's bytes, on the
  multi-choice streams an engine serves before its first usage chunk). An engine that changes its fingerprint
  behind the same URL (an upgrade) gives its next streams the previous one until a usage chunk tells the new.

The Responses API has no running count: its progress is one token per ``*.delta`` event (a lower bound) until
the closing event's ``response.usage.output_tokens``. An engine that reports nothing (it ignored the options)
is counted as before, one token per data event that carries choices.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.engine.vllm_api.reading import count, stream_usage

_USAGE_KEY = b',"usage":'
_FINAL = b'"choices":[]'
_INDEX = re.compile(rb'"choices":\[\{"index":(\d+)')
_CHOICE = b'"choices":[{"index":'
_COMPLETION = b'"completion_tokens":'
_DATA = b"data: "
_DONE = b"data: [DONE]"
_CLOSING = (b"event: response.completed\n", b"event: response.incomplete\n", b"event: response.failed\n")


@dataclass(frozen=True, slots=True)
class UsageAsk:
    """What the client itself asked of a stream's usage: the final usage chunk, usage on every chunk; and how
    many choices the stream carries (``n`` for each prompt), which tells when no other choice is still running."""

    final: bool = True
    continuous: bool = True
    choices: int = 1

    @property
    def everything(self) -> bool:
        return self.final and self.continuous


# The client asked for everything the engine sends: nothing is taken out.
EVERYTHING = UsageAsk()


def ask_engine_for_usage(body: dict[str, Any]) -> tuple[dict[str, Any], UsageAsk]:
    """A chat or completions stream's body as sent to the engine (usage on every chunk) and what the client
    asked, its options read as vLLM reads them. Options vLLM refuses are sent as they are, so that the engine's
    own answer (its validation error) stays what it would have been."""
    options = body.get("stream_options")
    asked = stream_usage(options)
    if asked is None:
        return body, EVERYTHING
    ask = UsageAsk(final=asked[0], continuous=asked[1], choices=_choice_count(body))
    if ask.everything:
        return body, ask  # the engine reads the client's own values as asking for everything
    sent = {**(options or {}), "include_usage": True, "continuous_usage_stats": True}
    return {**body, "stream_options": sent}, ask


def _choice_count(body: dict[str, Any]) -> int:
    """The choices of a stream, as vLLM numbers them: ``n`` for each prompt of a completions list (a list of
    token ids is one prompt). The guard has checked ``n``; a value vLLM would read otherwise counts as 1."""
    n = count(body, "n") or 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return n * len(prompt)
    return n


class Fingerprint:
    """The ``system_fingerprint`` one engine stamps on its answers, once a usage chunk has told it (``known``);
    ``value`` None: the engine stamps none (``--fingerprint-mode none``, or a vLLM without the field)."""

    __slots__ = ("known", "on_learn", "value")

    def __init__(self) -> None:
        self.known = False
        self.value: str | None = None
        self.on_learn: Callable[[], None] | None = None  # with --workers: tell the other processes at once

    def learn(self, value: str | None) -> None:
        changed = (self.known, self.value) != (True, value)
        self.known, self.value = True, value
        if changed and self.on_learn is not None:
            self.on_learn()


class StreamUsage:
    """Reads the engine's counts off a stream's whole events and gives back the events its client asked for.

    ``generated``: output tokens so far, summed over the choices; ``reported``: whether the engine's final
    figure was seen (the count is exact). ``fingerprint``: the engine's, as learned from earlier streams (and
    taught by this one's usage chunk); None: learned from this stream alone."""

    __slots__ = ("_all", "_ask", "_choices", "_ends", "_events", "_fingerprint", "_held", "_per_choice",
                 "_responses", "_stamps", "_sum", "generated", "reported")

    def __init__(self, route: str, ask: UsageAsk, fingerprint: Fingerprint | None = None) -> None:
        self._ask = ask
        self._all = ask.everything  # nothing to take out: the events go as they came
        self._responses = route == "responses"
        self._fingerprint = fingerprint
        # Without the usage chunk, vLLM stamps the fingerprint on each choice's last chunk (its end).
        self._stamps = not ask.final
        self._choices = ask.choices
        self._ends = 0  # the choices that ended so far
        self._per_choice: dict[int, int] = {}
        self._sum = 0  # the choices' running counts, summed
        self._events = 0  # the fallback's count: data events with choices
        self._held: list[bytes] = []  # ends waiting for the usage chunk right behind them
        self.generated = 0
        self.reported = False

    def feed(self, events: list[bytes]) -> list[bytes]:
        """The events to relay for ``events``, in order (some taken out or, for the usage chunk that follows
        them, the last ends held)."""
        if self._responses:
            for event in events:
                self._responses_event(event)
            return events
        if self._all:
            for event in events:
                if self._held or self._fast(event) is None:
                    self._chunk(event)
            return events
        out: list[bytes] = []
        for event in events:
            fast = None if self._held else self._fast(event)
            if fast is not None:
                out.append(fast)
            else:
                out.extend(self._chunk(event))
        if self._held and self._ends < self._choices:
            # Other choices still run: their next text may be an engine step away, and vLLM's stream carries
            # these ends before it. They go now, without the fingerprint no usage chunk has told yet.
            out.extend(self.close())
        return out

    def close(self) -> list[bytes]:
        """At the stream's end (or break): the events still held, as they came."""
        held, self._held = self._held, []
        return held

    # -- chat and completions -----------------------------------------------------------------------
    def _chunk(self, event: bytes) -> list[bytes]:
        if not event.startswith(_DATA) or event.startswith(_DONE):
            return self._after_held(event)
        at = event.rfind(_USAGE_KEY)
        if at < 0:
            if b'"usage"' in event:
                return self._parsed_chunk(event)
            if b'"choices":[{' in event and b'"delta":{"role"' not in event and not self._per_choice:
                self._events += 1
                self.generated = max(self.generated, self._events)
            return self._passing(event)
        start = at + len(_USAGE_KEY)
        end = _object_end(event, start)
        if end < 0:
            return self._parsed_chunk(event)
        try:
            usage = orjson.loads(event[start:end])
        except orjson.JSONDecodeError:
            return self._parsed_chunk(event)
        if event.find(_FINAL, 0, at) >= 0:
            return self._final(event, usage)
        match = _INDEX.search(event, 0, at)
        if match is None:
            return self._parsed_chunk(event)
        self._running(int(match.group(1)), usage)
        if not self._ask.continuous:
            event = event[:at] + event[end:]
        return self._passing(event)

    def _fast(self, event: bytes) -> bytes | None:
        """A running chunk as vLLM writes it (``"choices":[{"index":N`` first, a flat usage object of plain
        digits, ``completion_tokens`` in it), read with ``find`` and slices alone: counted, and returned as it is
        relayed. None for anything else (the usage chunk, ``[DONE]``, a choice's end to stamp, a nested usage,
        other spacing), which ``_chunk`` reads; nothing is counted then. At thousands of events a second per
        core the parse was the relay's largest piece of Python: the usage step took 4.0 us an event with it and
        1.8 us with this, on one chunk of vLLM's shape (the two readings agree: property-tested)."""
        at = event.rfind(_USAGE_KEY)
        if at < 0 or not event.startswith(_DATA) or (self._stamps and b'"finish_reason":"' in event):
            return None
        start = at + len(_USAGE_KEY)
        end = event.find(b"}", start)
        if end < 0 or event.find(b"{", start + 1, end) >= 0:
            return None
        key, choice = event.find(_COMPLETION, start, end), event.find(_CHOICE, 0, at)
        if key < 0 or choice < 0:
            return None
        key += len(_COMPLETION)
        digits = event[key:end]  # vLLM writes it last; else up to the next field
        if not digits.isdigit():
            digits = event[key : event.find(b",", key, end)]
        choice += len(_CHOICE)
        index = event[choice : event.find(b",", choice, at)]
        if not (digits.isdigit() and index.isdigit()):
            return None
        self._count(int(index), int(digits))
        return event if self._ask.continuous else event[:at] + event[end + 1 :]

    def _running(self, index: int, usage: Any) -> None:
        count = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(count, int) and not isinstance(count, bool):
            self._count(index, count)

    def _count(self, index: int, count: int) -> None:
        """A choice's running count: the stream's is the sum over its choices (kept as it changes)."""
        if not self.reported:
            self._sum += count - self._per_choice.get(index, 0)
            self._per_choice[index] = count
            if self._sum > self.generated:
                self.generated = self._sum

    def _final(self, event: bytes, usage: Any) -> list[bytes]:
        count = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(count, int) and not isinstance(count, bool):
            self.generated = count
            self.reported = True
        held, self._held = self._held, []
        if held or self._fingerprint is not None:
            fingerprint = _fingerprint(event)  # one parse of one small chunk a stream
            if self._fingerprint is not None:
                self._fingerprint.learn(fingerprint)
            if held and fingerprint is not None:
                held = [_stamped(chunk, fingerprint) for chunk in held]
        return [*held, event] if self._ask.final else held

    def _passing(self, event: bytes) -> list[bytes]:
        """A choice's chunk, cleaned: its end stamped as vLLM stamps it without usage."""
        if self._stamps and b'"finish_reason":"' in event:
            return self._end(event)
        return self._after_held(event)

    def _end(self, event: bytes) -> list[bytes]:
        """A choice's last chunk: stamped with the engine's fingerprint when it is known (nothing to stamp when
        the engine stamps none); while it is not, held for the usage chunk that tells it, which vLLM writes
        right behind the last choice's end (``feed`` lets an end go at once while other choices still run)."""
        self._ends += 1
        if b'"system_fingerprint":' not in event:  # else the engine stamped it itself
            known = self._fingerprint
            if known is None or not known.known:
                self._held.append(event)
                return []
            if known.value is not None:
                event = _stamped(event, known.value)
        return self._after_held(event)

    def _after_held(self, event: bytes) -> list[bytes]:
        """``event``, behind the ends still held: nothing but the usage chunk passes them."""
        if self._held:
            held, self._held = self._held, []
            return [*held, event]
        return [event]

    def _parsed_chunk(self, event: bytes) -> list[bytes]:
        """The slow path, for a chunk not written as vLLM writes them: parsed and, if changed, written again."""
        try:
            data = orjson.loads(event[len(_DATA):])
        except orjson.JSONDecodeError:
            return self._after_held(event)
        if not isinstance(data, dict) or not isinstance(data.get("usage"), dict):
            return self._passing(event)
        choices = data.get("choices")
        if choices == []:
            return self._final(event, data["usage"])
        if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)
                and isinstance(choices[0].get("index"), int)):
            return self._after_held(event)
        self._running(choices[0]["index"], data["usage"])
        if not self._ask.continuous:
            del data["usage"]
            event = _DATA + orjson.dumps(data) + b"\n\n"
        return self._passing(event)

    # -- responses ----------------------------------------------------------------------------------
    def _responses_event(self, event: bytes) -> None:
        if self.reported:
            return
        head, _, _ = event.partition(b"\n")
        if head.startswith(b"event: response.") and head.endswith(b".delta"):
            self._events += 1
            self.generated = max(self.generated, self._events)
        elif event.startswith(_CLOSING):
            count = _responses_output_tokens(event)
            if count is not None:
                self.generated = count
                self.reported = True


def _object_end(data: bytes, start: int) -> int:
    """The end of the JSON object at ``start`` (a usage figure: numbers and objects of numbers), or -1. Braces
    are matched with ``find`` and ``count``, at C speed; the caller's parse checks what they enclose."""
    if data[start : start + 1] != b"{":
        return -1
    end = start
    while True:
        end = data.find(b"}", end + 1)
        if end < 0:
            return -1
        if data.count(b"{", start, end) == data.count(b"}", start, end + 1):
            return end + 1


def _fingerprint(event: bytes) -> str | None:
    try:
        data = orjson.loads(event[len(_DATA):])
    except orjson.JSONDecodeError:
        return None
    value = data.get("system_fingerprint") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def _stamped(chunk: bytes, fingerprint: str) -> bytes:
    """A choice's last chunk as vLLM writes it without usage: ``system_fingerprint`` after ``choices``."""
    if chunk.endswith(b"]}\n\n"):
        return chunk[:-3] + b',"system_fingerprint":' + orjson.dumps(fingerprint) + b"}\n\n"
    try:
        data = orjson.loads(chunk[len(_DATA):])
    except orjson.JSONDecodeError:
        return chunk
    if not isinstance(data, dict):
        return chunk
    data["system_fingerprint"] = fingerprint
    return _DATA + orjson.dumps(data) + b"\n\n"


def _responses_output_tokens(event: bytes) -> int | None:
    _, _, rest = event.partition(b"\ndata: ")
    try:
        data = orjson.loads(rest)
    except orjson.JSONDecodeError:
        return None
    response = data.get("response") if isinstance(data, dict) else None
    usage = response.get("usage") if isinstance(response, dict) else None
    count = usage.get("output_tokens") if isinstance(usage, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None
