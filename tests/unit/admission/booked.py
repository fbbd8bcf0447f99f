"""A request as the projection reads it, and lengths learned, for the projection's tests."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission.lengths import OutputLengths


@dataclass
class Booked:
    """A request of a 152-token prompt allowed 168 tokens: 20 blocks of 16."""

    prompt_tokens: int = 152
    max_tokens: int = 168
    min_output: int = 0  # tokens per sequence it surely generates (ignore_eos, min_tokens)
    n: int = 1
    blocks: int = 20
    generated: int = 0
    credited: int | None = None
    admitted_at: float | None = None
    credits: int = 0
    prefix_blocks: int = 0  # no prefix sharing: the projection as it was before sharing
    shared_blocks: int = 0
    keys: tuple[str, ...] = ()
    family: str = "m/chat"
    tenant: str = "default"

    def credit(self, taken_at: float, window: float) -> None:
        self.credits += 1
        self.credited = self.generated

    def forget_credit(self) -> None:
        self.credited = None


def stopped_at(*lengths: int) -> OutputLengths:
    """Answers of ``m/chat`` allowed 168 tokens that stopped at ``lengths``."""
    seen = OutputLengths()
    for tokens in lengths:
        seen.add("m/chat", "default", 168, tokens)
    return seen


EIGHT = stopped_at(*[8] * 8)  # eight answers of 8 tokens
SPREAD = stopped_at(4, 8, 8, 8, 40, 40, 40, 100, 100, 100)
