"""Micro-benchmark of prompt counting: the gateway's counter against a plain ``apply_chat_template``, and the
cost of the prompt's token ids against that of its count.

Run by ``python -m bench run counting``. ``synthetic_chat`` also gives tests long, varied chats.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.guard.counting import LocalCounter, load_tokenizer
from gateway.guard.counting.truncation import Messages
from gateway.tools.tinymodel import build_tokenizer, corpus_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def synthetic_chat(tokenizer: PreTrainedTokenizerBase, tokens: int, turn_tokens: int = 400) -> dict[str, Any]:
    """A system prompt and alternating user/assistant turns of varied prose, about ``tokens`` long."""
    rng = random.Random(tokens)
    words = corpus_text().split()
    per_word = len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) / len(words)
    messages: Messages = [{"role": "system", "content": "You are a helpful assistant."}]
    total = 0
    while total < tokens:
        n = min(turn_tokens, tokens - total)
        text = " ".join(rng.choice(words) for _ in range(max(1, round(n / per_word))))
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": text})
        total += n
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "Please go on."})
    return {"messages": messages}


def bench_counting(
    tokenizer: PreTrainedTokenizerBase | None = None, sizes: tuple[int, ...] = (1024, 8192, 32768), repeat: int = 5
) -> dict[str, dict[str, float]]:
    """Time counting chats of ``sizes`` tokens; best of ``repeat`` runs, milliseconds.

    Per size: ``tokens`` (exact count), ``naive_ms`` (``apply_chat_template(tokenize=True)``), ``cold_ms``
    (empty cache), ``prefix_ms`` (the same chat after counting it without its last user turn, as in a
    conversation that grows by one turn) and ``warm_ms`` (counted before); ``naive_cpu_ms`` and
    ``cold_cpu_ms`` are the CPU time of the process (all threads), steadier than wall time on a busy
    machine. Uses the tiny model's tokenizer when none is given.
    """
    tokenizer = tokenizer or _tiny_tokenizer()
    counter = LocalCounter(tokenizer)
    return {str(size): _bench_one(counter, synthetic_chat(tokenizer, size), repeat) for size in sizes}


def _tiny_tokenizer() -> PreTrainedTokenizerBase:
    with tempfile.TemporaryDirectory() as tmp:
        return load_tokenizer(str(build_tokenizer(Path(tmp))))


def _timed(repeat: int, fn: Callable[[], object], before: Callable[[], object], clock: Callable[[], float]) -> float:
    times = []
    for _ in range(repeat):
        before()
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1000)
    return min(times)


def _bench_one(counter: LocalCounter, body: dict[str, Any], repeat: int) -> dict[str, float]:
    earlier = {"messages": body["messages"][:-1]}

    def naive() -> object:
        return counter.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)

    def count() -> object:
        return counter.count_chat_sync(body)

    def count_earlier() -> None:
        counter.text.clear_cache()
        counter.count_chat_sync(earlier)

    def nothing() -> None:
        return None

    wall, cpu = time.perf_counter, time.process_time
    return {
        "tokens": counter.count_chat_sync(body).token_count,
        "naive_ms": _timed(repeat, naive, nothing, wall),
        "cold_ms": _timed(repeat, count, counter.text.clear_cache, wall),
        "prefix_ms": _timed(repeat, count, count_earlier, wall),
        "warm_ms": _timed(repeat, count, nothing, wall),
        "naive_cpu_ms": _timed(repeat, naive, nothing, cpu),
        "cold_cpu_ms": _timed(repeat, count, counter.text.clear_cache, cpu),
    }


def bench_token_ids(
    tokenizer: PreTrainedTokenizerBase | None = None, sizes: tuple[int, ...] = (1024, 8192, 32768), repeat: int = 7
) -> dict[str, dict[str, float]]:
    """Time a chat's ids (``tokenize_chat_sync``) against its count (``count_chat_sync``); best of ``repeat``, ms.

    Per size: ``tokens``, then ``{count,ids}_{cold,prefix,warm}_ms`` with the cases of ``bench_counting``
    (empty cache; earlier turns tokenized before; the same chat again). Each size's ids are first checked
    against the tokenizer's own ``apply_chat_template(tokenize=True)``.
    """
    tokenizer = tokenizer or _tiny_tokenizer()
    counter = LocalCounter(tokenizer)
    out: dict[str, dict[str, float]] = {}
    for size in sizes:
        body = synthetic_chat(tokenizer, size)
        ids = counter.tokenize_chat_sync(body).ids
        expected = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_dict=False)
        if ids != tuple(expected):
            raise AssertionError(f"the ids of the {size}-token chat differ from the tokenizer's own")
        out[str(size)] = {"tokens": float(len(ids)), **_bench_ids_one(counter, body, repeat)}
    return out


def _bench_ids_one(counter: LocalCounter, body: dict[str, Any], repeat: int) -> dict[str, float]:
    earlier = {"messages": body["messages"][:-1]}

    def seen_before(run: Callable[[dict[str, Any]], object]) -> None:
        counter.text.clear_cache()
        run(earlier)

    cases: dict[str, Callable[[Callable[[dict[str, Any]], object]], object]] = {
        "cold": lambda run: counter.text.clear_cache(),
        "prefix": seen_before,
        "warm": lambda run: None,
    }
    runs: dict[str, Callable[[dict[str, Any]], object]] = {
        "count": counter.count_chat_sync,
        "ids": counter.tokenize_chat_sync,
    }
    times: dict[str, list[float]] = {}
    # Count and ids take turns, so that a machine whose speed drifts between runs slows both alike.
    for _ in range(repeat):
        for case, before in cases.items():
            for kind, run in runs.items():
                before(run)
                t0 = time.perf_counter()
                run(body)
                times.setdefault(f"{kind}_{case}_ms", []).append((time.perf_counter() - t0) * 1000)
    return {key: min(values) for key, values in times.items()}
