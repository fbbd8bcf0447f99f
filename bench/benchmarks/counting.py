"""Prompt counting, in-process: the gateway's counter against a plain ``apply_chat_template``, and the cost of a
prompt's token ids against that of its count. No server.

    python -m bench run counting [--sizes 1024 8192 32768] [--inner 5] [--repeat 3]

Chats of a system prompt and alternating turns of varied prose (the tiny model's tokenizer), per size: the naive
count (``apply_chat_template(tokenize=True)``), the gateway's counter cold (empty cache), with the conversation's
earlier turns counted before (a conversation that grows by one turn), and the same chat again; wall and CPU
time, the best of ``--inner`` tries. Then the chat's ids (``tokenize_chat_sync``, each checked against the
tokenizer's own) against its count in the same three cases. Each turn repeats it all; medians over turns.
"""

from __future__ import annotations

import argparse

from bench.harness.context import Context
from bench.harness.pairing import in_turns
from bench.harness.results import Measure, Result
from bench.workloads.counting import bench_counting, bench_token_ids

SUMMARY = "prompt counting in-process: the gateway's counter vs apply_chat_template, ids vs count, by chat size"
TARGETS = ["counter"]
DEFAULT_TARGETS = ["counter"]
COUNT_FIELDS = {"tokens": "tokens", "naive_ms": "naive apply_chat_template ms", "cold_ms": "gateway cold ms",
                "prefix_ms": "gateway, earlier turns counted ms", "warm_ms": "gateway, repeated ms",
                "naive_cpu_ms": "naive, CPU ms", "cold_cpu_ms": "gateway cold, CPU ms"}  # fmt: skip
IDS_FIELDS = {f"{kind}_{case}_ms": f"{kind} {what} ms" for case, what in
              (("cold", "cold"), ("prefix", "with earlier turns seen"), ("warm", "repeated"))
              for kind in ("count", "ids")}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(pin=False)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 8192, 32768], help="chat sizes in tokens")
    parser.add_argument("--inner", type=int, default=5, help="tries per figure within a turn; the best is kept (5)")


def measures(sizes: list[int]) -> list[Measure]:
    out = []
    for size in sizes:
        out += [Measure(f"s{size}_{k}", f"{size}-token chat: {label}", ".0f" if k == "tokens" else ".2f", "none")
                for k, label in COUNT_FIELDS.items()]
        out += [Measure(f"s{size}_{k}", f"{size}-token chat: {label}", ".2f", "none")
                for k, label in IDS_FIELDS.items()]
    return out


def run(ctx: Context) -> Result:
    sizes = tuple(ctx.args.sizes)

    def one(target: str, turn: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for size, f in bench_counting(sizes=sizes, repeat=ctx.args.inner).items():
            out |= {f"s{size}_{k}": v for k, v in f.items()}
        for size, f in bench_token_ids(sizes=sizes, repeat=ctx.args.inner).items():
            out |= {f"s{size}_{k}": v for k, v in f.items() if k != "tokens"}
        return out

    runs = in_turns(["counter"], ctx.args.repeat, one, lambda t, n, f: ctx.say(f"turn {n + 1} done"))
    notes = [f"the tiny model's tokenizer; best of {ctx.args.inner} tries a figure within a turn, medians of turns"]
    return ctx.result(measures(list(sizes)), runs, [], notes=notes)
