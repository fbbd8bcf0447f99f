"""What one first-token sample costs the admission as the rate grows: ``deadlines.FirstTokens.add`` (the window's
removals included) on a clock advanced by ``1 / rate`` a sample, once the ten-second window has filled.

    python -m bench.workloads.first_tokens [--rates 300 1000 3000 10000] [--samples 20000]   # one JSON object

Run with the gateway of this tree (or a commit's) first on the path; its admission compiled where a build matches.
Prints the CPU microseconds per sample at each rate and the values the window holds then.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import orjson


def per_sample(rate: float, samples: int, seed: int = 7) -> tuple[float, int]:
    """CPU us per ``add`` at ``rate`` samples a second, and how many values the window held."""
    from gateway.admission.deadlines import WINDOW_SECONDS, FirstTokens

    rng = random.Random(seed)
    now = [0.0]
    tokens = FirstTokens(lambda: now[0])
    step = 1.0 / rate
    values = [rng.uniform(0.01, 0.2) for _ in range(samples)]
    for _ in range(int(rate * (WINDOW_SECONDS + 2))):  # the window full before the clock starts
        now[0] += step
        tokens.add(rng.uniform(0.01, 0.2), queued=True)
    start = time.process_time()
    for value in values:
        now[0] += step
        tokens.add(value, queued=True)
    spent = time.process_time() - start
    return spent / samples * 1e6, round(rate * WINDOW_SECONDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[300, 1000, 3000, 10000])
    parser.add_argument("--samples", type=int, default=20000)
    args = parser.parse_args(argv)
    out = {}
    for rate in args.rates:
        us, held = per_sample(rate, args.samples)
        out[f"{rate:g}/s"] = {"us_per_sample": round(us, 3), "window_values": held}
    sys.stdout.write(orjson.dumps(out).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
