"""Chat truncation: fit a conversation into a token budget without making it invalid.

Policy (docs/concepts/counting.md, "A prompt over the limit"):
keep the system messages and the newest turns; drop the oldest whole turns first
(an assistant message with tool calls and the tool answers to it go together); when even the last turn
is too long, cut text from the front of the oldest remaining text. The result always starts its
non-system part with a user turn and is never empty. Counting is passed in, so the same algorithm runs
over the local tokenizer and over the upstream's /tokenize.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.errors import ContextLengthExceeded

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class ChatTruncation:
    messages: Messages  # a valid request's messages; system messages kept
    prompt_tokens: int  # count after truncation (<= budget)
    removed_tokens: int  # original count - new count


CountMessages = Callable[[Messages], Awaitable[int]]
DropFront = Callable[[str, int], Awaitable[str]]


def _is_system(message: dict[str, Any]) -> bool:
    return message.get("role") in ("system", "developer")


def _text_slots(messages: Messages) -> list[tuple[int, int | None]]:
    """(message index, part index or None) of every piece of text that may be cut, oldest first."""
    slots: list[tuple[int, int | None]] = []
    for i, m in enumerate(messages):
        if _is_system(m):
            continue
        content = m.get("content")
        if isinstance(content, str) and content:
            slots.append((i, None))
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type", "text") == "text" and part.get("text"):
                    slots.append((i, j))
    return slots


def _slot_text(messages: Messages, slot: tuple[int, int | None]) -> str:
    i, j = slot
    content = messages[i]["content"]
    return str(content if j is None else content[j]["text"])


def _with_slot_text(messages: Messages, slot: tuple[int, int | None], text: str) -> Messages:
    i, j = slot
    out = list(messages)
    message = dict(out[i])
    if j is None:
        message["content"] = text
    else:
        parts = list(message["content"])
        parts[j] = {**parts[j], "text": text}
        message["content"] = parts
    out[i] = message
    return out


class _TurnCuts:
    """The messages kept by each allowed cut, from keeping everything to keeping the least; each built only when
    asked for (bisection asks for a few; building all of them costs turns x messages, beyond reach for a body
    of a hundred thousand messages).

    Non-system messages form turns: an assistant message with tool calls and the tool answers after it
    form one. A cut drops whole turns from the oldest and must leave a user message first, so the last
    user turn and everything after it always stay; system messages always stay, in their places.
    """

    def __init__(self, messages: Messages) -> None:
        self._messages = messages
        self._systems = [i for i, m in enumerate(messages) if _is_system(m)]
        turns: list[list[int]] = []
        for i, m in enumerate(messages):
            if _is_system(m):
                continue
            if m.get("role") == "tool" and turns:
                turns[-1].append(i)
            else:
                turns.append([i])
        self._turns = turns
        self._starts = [0] + [t for t in range(1, len(turns)) if messages[turns[t][0]].get("role") == "user"]

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, k: int) -> Messages:
        start = self._starts[k]
        keep = sorted(self._systems + [i for turn in self._turns[start:] for i in turn])
        return [self._messages[i] for i in keep]


async def truncate_messages(
    messages: Messages, budget: int, count: CountMessages, drop_front: DropFront
) -> ChatTruncation:
    """Fit ``messages`` into ``budget`` tokens: drop the oldest whole turns, then cut text from the front."""
    original = await count(messages)
    if original <= budget:
        return ChatTruncation(list(messages), original, 0)
    cuts = _TurnCuts(messages)

    async def done(kept: Messages, n: int) -> ChatTruncation:
        return ChatTruncation(kept, n, original - n)

    # Fewer turns never count more, so the first cut that fits is found by bisection.
    last = await count(cuts[-1]) if len(cuts) > 1 else original
    if last <= budget:
        lo, hi, best = 1, len(cuts) - 1, (cuts[-1], last)
        while lo < hi:
            mid = (lo + hi) // 2
            n = await count(cuts[mid])
            if n <= budget:
                best, hi = (cuts[mid], n), mid
            else:
                lo = mid + 1
        return await done(*best)

    kept = cuts[-1]
    slots = _text_slots(kept)
    emptied = kept
    for slot in slots:
        emptied = _with_slot_text(emptied, slot, "")
    minimum = await count(emptied) if slots else last
    if minimum > budget:
        raise ContextLengthExceeded(
            f"The conversation cannot be truncated to {budget} tokens: its system messages and its last turn "
            f"need at least {minimum} tokens even with their text cut (it uses {original} tokens).",
            param="messages",
        )
    current = last
    for slot in slots:
        without = _with_slot_text(kept, slot, "")
        n_without = await count(without)
        if n_without > budget:
            kept, current = without, n_without
            continue
        text = _slot_text(kept, slot)
        drop = current - budget
        while True:
            shorter = await drop_front(text, drop)
            candidate = _with_slot_text(kept, slot, shorter)
            n = await count(candidate) if shorter else n_without
            if n <= budget:
                return await done(candidate, n)
            drop += n - budget
    # Every slot emptied fits by the minimum check above; reaching here means no slot had text.
    return await done(emptied, minimum)
