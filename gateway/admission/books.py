"""The KV books: what the admitted requests hold, each request's own blocks plus the shared prompt blocks once.

``committed`` (physical) is what strict keeps within the budget; ``logical`` is what the same requests would book
without prefix sharing, and their ratio is how much sharing saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from gateway.admission.ledger import Ledger
from gateway.admission.prefix import BlockKey
from gateway.admission.sharing import SharedBlocks


class Booked(Protocol):
    """What the books read of, and tell, a reservation."""

    @property
    def keys(self) -> tuple[BlockKey, ...]: ...
    @property
    def own_blocks(self) -> int: ...
    @property
    def logical_blocks(self) -> int: ...
    def quote(self, prefix_blocks: int) -> None: ...
    def recount(self, block_size: int, sharing: bool) -> int: ...


class Books:
    def __init__(self) -> None:
        self._own = Ledger()
        self._shared = SharedBlocks()
        self._logical = 0

    @property
    def committed(self) -> int:
        """Blocks booked: each request's own, and the shared prompt blocks once."""
        return self._own.committed + self._shared.held

    @property
    def logical(self) -> int:
        return self._logical

    @property
    def shared_held(self) -> int:
        return self._shared.held

    def held_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, requests in flight hold."""
        return self._shared.held_prefix(keys)

    def quote(self, r: Booked) -> None:
        """Tell a waiting request what its shared prompt blocks would add now."""
        if r.keys:
            r.quote(self._shared.missing(r.keys))

    def commit(self, r: Booked) -> None:
        r.quote(self._shared.hold(r.keys))
        self._own.commit(r.own_blocks)
        self._logical += r.logical_blocks

    def release(self, r: Booked) -> None:
        self._own.release(r.own_blocks)
        self._shared.release(r.keys)
        self._logical -= r.logical_blocks

    def recount(self, r: Booked, block_size: int, sharing: bool) -> None:
        """Count an admitted request again in another block size or sharing mode, and book it as recounted."""
        self._shared.release(r.keys)
        self._logical -= r.logical_blocks
        old = r.recount(block_size, sharing)
        self._own.resize(old, r.own_blocks)
        r.quote(self._shared.hold(r.keys))
        self._logical += r.logical_blocks

    def status(self, mode: str, on: bool) -> dict[str, Any]:
        """The sharing part of ``/guard/status``."""
        physical = self.committed
        return {
            "mode": mode,
            "on": on,
            "logical_committed_blocks": self._logical,
            "physical_committed_blocks": physical,
            "shared_blocks_held": self._shared.held,
            "shared_block_references": self._shared.references,
            "sharing_ratio": round(self._logical / physical, 3) if physical else None,
        }
