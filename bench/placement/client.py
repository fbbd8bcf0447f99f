"""One run of the realistic benchmark's traffic against a server already running: 32 chat streams/s for 60 s, the
bench's own plans, words and client; prints its figures as JSON. ``python bench/placement/client.py SEED URL WORDS``
(WORDS: which words to draw, so that no run finds another's prompts in vLLM's prefix cache)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

from bench.targets import engines
from bench.workloads.realistic import figures, plan, prompt
from bench.workloads.realistic_clients import CLIENTS


def main(seed: int, url: str, words: int) -> None:
    model = engines.tiny_model()
    plans = plan(32.0, 60.0, seed)
    texts = [prompt(p, i, seed, words) for i, p in enumerate(plans)]
    outcomes = asyncio.run(CLIENTS["aiohttp"](url, plans, texts, engines.eos_id(model), 30.0))
    got = dataclasses.asdict(figures(outcomes, 5.0))
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in got.items()}))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
