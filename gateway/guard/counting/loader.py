"""Loading the model's tokenizer from a local directory or the local Hugging Face cache, never downloading."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TokenizerUnavailable(Exception):
    """No tokenizer could be loaded from the given source without downloading."""


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """A local tokenizer directory, or a hub id already in the local HF cache (never downloads).

    Slow (seconds: it imports transformers); call it from a worker thread, not the event loop.
    """
    looks_like_path = source.startswith(("/", "./", "../", "~")) or Path(source).expanduser().exists()
    if looks_like_path and not Path(source).expanduser().is_dir():
        raise TokenizerUnavailable(f"tokenizer directory {source!r} does not exist")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            str(Path(source).expanduser()) if looks_like_path else source,
            local_files_only=True,
            trust_remote_code=False,
        )
    except Exception as exc:  # transformers raises OSError, ValueError, ImportError, ... by case
        where = "directory" if looks_like_path else "hub id (local cache only)"
        raise TokenizerUnavailable(f"cannot load a tokenizer from {where} {source!r}: {exc}") from exc
