"""Exact prompt token counts and ids, as vLLM 0.32 computes them.

Two counters share one interface (``Counter``): ``LocalCounter`` runs the model's own tokenizer (``local``,
with the cached text counter of ``text``); ``RemoteCounter`` asks the engine's ``/tokenize`` when no tokenizer
can be loaded here (``remote``). Chat requests are first rewritten as vLLM rewrites them (``chatformat``), a
request's own template renders only in a sandboxed process (``templates``), and both counters truncate chats
by the same rules (``truncation``).
"""

from gateway.guard.counting.counter import Counter, PromptField, PromptTokens, PromptTruncation
from gateway.guard.counting.loader import TokenizerUnavailable, load_tokenizer
from gateway.guard.counting.local import ChatPrompt, LocalCounter
from gateway.guard.counting.remote import RemoteCounter
from gateway.guard.counting.text import TextCounter
from gateway.guard.counting.truncation import ChatTruncation

__all__ = [
    "ChatPrompt",
    "ChatTruncation",
    "Counter",
    "LocalCounter",
    "PromptField",
    "PromptTokens",
    "PromptTruncation",
    "RemoteCounter",
    "TextCounter",
    "TokenizerUnavailable",
    "load_tokenizer",
]
