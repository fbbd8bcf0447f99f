"""The gateway of this tree against the gateway of another commit, on the same simulator, in turns.

A refactoring must not cost speed. This checks out ``--baseline`` (default ``HEAD~1``) in a temporary git
worktree, starts one gateway from each tree in front of one zero-delay vLLM simulator, and measures both in
turns, ``--rounds`` times: latency at concurrency 1, requests per second at 64, streams of 20 events per
second at 16. It prints the medians and the ratio this tree / baseline (1.00x: no change; single runs on a
2-core machine move by tens of percent, which is why the rounds alternate and the medians are compared). Who goes
first in a round alternates, and the first measured is often the slower: an even number of rounds keeps that fair.
``--baseline HEAD`` compares the tree with itself: the noise floor of the machine at that moment.

    python bench/compare_commits.py [--baseline REF] [--seconds 5] [--rounds 4] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from overhead import CHAT, SIM_CODE, STREAM, free_port, load, pinned, process  # noqa: E402

MEASURES = (
    "latency c=1 p50 (ms)", "latency c=1 p99 (ms)", "req/s c=64", "p99 c=64 (ms)", "gateway CPU per request c=64 (us)",
    "streams/s c=16",
)
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time: what a request costs the gateway, whatever the load generator's speed."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="bench-baseline-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), ref], check=True,
                   capture_output=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=False,
                       capture_output=True)


@contextlib.contextmanager
def gateway(tree: Path, upstream: str, tokenizer: Path) -> Iterator[tuple[str, int]]:
    """``vllm-guard serve`` from ``tree``'s own source (it comes first on the path)."""
    port = free_port()
    cmd = [
        *pinned(1), sys.executable, "-m", "gateway.cli", "serve", "--upstream", upstream, "--port", str(port),
        "--host", "127.0.0.1", "--tokenizer", str(tokenizer), "--log-level", "warning", "--max-queue", "10000",
    ]
    url = f"http://127.0.0.1:{port}"
    with process(cmd, url + "/health", cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}) as proc:
        yield url, proc.pid


def measure(url: str, pid: int, seconds: float) -> dict[str, float]:
    c1 = load(url + "/v1/chat/completions", CHAT, 1, seconds)
    cpu0 = cpu_seconds(pid)
    c64 = load(url + "/v1/chat/completions", CHAT, 64, seconds)
    cpu_per_request = (cpu_seconds(pid) - cpu0) / max(1, c64.requests) * 1e6
    s16 = load(url + "/v1/chat/completions", STREAM, 16, seconds)
    if c1.errors or c64.errors or s16.errors:
        raise SystemExit(f"{url}: non-200 answers during the load")
    return {
        "latency c=1 p50 (ms)": c1.p50_ms, "latency c=1 p99 (ms)": c1.p99_ms, "req/s c=64": c64.rps,
        "p99 c=64 (ms)": c64.p99_ms, "gateway CPU per request c=64 (us)": cpu_per_request, "streams/s c=16": s16.rps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="HEAD~1", help="the commit to compare with (default HEAD~1)")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each load phase")
    parser.add_argument(
        "--rounds", type=int, default=4,
        help="rounds, each measuring both gateways in turn, who goes first alternating: keep it even",
    )
    parser.add_argument("--markdown", type=Path, help="also write the table as markdown here")
    args = parser.parse_args()

    from gateway.tools.tinymodel import build_tokenizer

    tokenizer = build_tokenizer(Path(tempfile.mkdtemp(prefix="bench-compare-")) / "tokenizer")
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    runs: dict[str, list[dict[str, float]]] = {"this tree": [], args.baseline: []}
    with (
        worktree(args.baseline) as base_tree,
        process([*pinned(0), sys.executable, "-c", SIM_CODE.format(root=str(ROOT), port=sim_port)],
                sim_url + "/health"),
        gateway(ROOT, sim_url, tokenizer) as (new_url, new_pid),
        gateway(base_tree, sim_url, tokenizer) as (old_url, old_pid),
    ):
        for url in (new_url, old_url):
            for body in (CHAT, STREAM):
                load(url + "/v1/chat/completions", body, 4, 1.0)  # warm-up
        for k in range(args.rounds):
            order = [("this tree", new_url, new_pid), (args.baseline, old_url, old_pid)]
            for name, url, pid in order if k % 2 == 0 else reversed(order):
                runs[name].append(measure(url, pid, args.seconds))
                print(f"round {k + 1}: {name}: {runs[name][-1]}", flush=True)
    lines = [
        f"Command: `python bench/compare_commits.py --baseline {args.baseline} --seconds {args.seconds:g} "
        f"--rounds {args.rounds}`; medians of {args.rounds} rounds taken in turns",
        "",
        f"| measure | {args.baseline} | this tree | this tree / baseline |",
        "| --- | --- | --- | --- |",
    ]
    for m in MEASURES:
        new = statistics.median(r[m] for r in runs["this tree"])
        old = statistics.median(r[m] for r in runs[args.baseline])
        lines.append(f"| {m} | {old:.2f} | {new:.2f} | {new / old:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
