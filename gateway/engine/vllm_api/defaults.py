"""vLLM's defaults that the gateway relies on when the engine does not say."""

from __future__ import annotations

# The KV block size when --block-size is not given: 16 on CUDA (and most backends), 128 on the CPU backend.
DEFAULT_BLOCK_SIZE = 16
CPU_BLOCK_SIZE = 128


def default_block_size(device: str | None) -> int:
    """vLLM's block size for ``device`` when --block-size is not given."""
    return CPU_BLOCK_SIZE if device is not None and device.lower() == "cpu" else DEFAULT_BLOCK_SIZE
