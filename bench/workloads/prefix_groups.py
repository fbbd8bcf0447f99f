"""The two-prefix-group workload: vLLM's own benchmark client, ``prefix_repetition`` dataset, two random shared
prefixes each followed in half the requests by a unique suffix; the traffic where placement by prefix pays."""

from __future__ import annotations

import argparse
from pathlib import Path

from testing.servers import SERVED_MODEL_NAME

GROUPS = 2  # prefix groups


def prefix_groups_args(args: argparse.Namespace, model: Path, base: str, seed: int) -> list[str]:
    """Two shared prefixes, each in half the requests; the seed draws new prefixes, so no run hits the last's."""
    return [
        "--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions", "--model", SERVED_MODEL_NAME,
        "--tokenizer", str(model), "--seed", str(seed), "--request-rate", "inf", "--disable-tqdm",
        "--max-concurrency", str(args.max_concurrency), "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(GROUPS),
        "--prefix-repetition-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--ignore-eos", "--percentile-metrics", "ttft", "--metric-percentiles", "99",
    ]  # fmt: skip
