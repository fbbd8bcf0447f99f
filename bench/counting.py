"""Micro-benchmark of prompt counting: the gateway's counter against a plain ``apply_chat_template``.

Run by ``bench/overhead.py`` (its counting table); ``synthetic_chat`` also gives tests long, varied chats.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.guard.counting import LocalCounter, load_tokenizer  # noqa: E402
from gateway.guard.counting.truncation import Messages  # noqa: E402
from gateway.tools.tinymodel import build_tokenizer, corpus_text  # noqa: E402

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
    if tokenizer is None:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = load_tokenizer(str(build_tokenizer(Path(tmp))))
    counter = LocalCounter(tokenizer)
    return {str(size): _bench_one(counter, synthetic_chat(tokenizer, size), repeat) for size in sizes}


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
