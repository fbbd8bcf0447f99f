"""Short requests at a fixed concurrency with wrk (C, one thread): latency percentiles and requests a second, the
cheapest load generator for a core shared with the engine. Each chat carries a number of its own, so that no
target answers it from a cache of identical ones."""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any

from bench.harness.processes import pinned

# A system prompt and a one-word question: the gateway counts it with its tokenizer, the engine answers 1 token.
SHORT_CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Question {n}: what is the capital of France? Answer in one word."},
    ],
    "max_tokens": 1,
}

SCRIPT = """
local template = os.getenv("BENCH_BODY")
local count_header = os.getenv("BENCH_COUNT_HEADER") or ""
local prefix_len = tonumber(os.getenv("BENCH_COUNT_PREFIX") or "12")
local threads = {}
setup = function(thread)
  table.insert(threads, thread)
  thread:set("base", (#threads - 1) * 1000000000)  -- each thread's chats numbered apart
end
counts = {}
if count_header ~= "" then
  -- Answers by the first characters of a header (a gateway's request id names the process that served it).
  response = function(status, headers, body)
    local value = headers[count_header]
    local key = value and string.sub(value, 1, prefix_len) or "-"
    counts[key] = (counts[key] or 0) + 1
  end
end
if template ~= "" then
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end
local counter = 0
request = function()
  if template == "" then return wrk.format("GET") end
  counter = counter + 1
  return wrk.format(nil, nil, nil, (string.gsub(template, "{n}", tostring(base + counter))))
end
done = function(summary, latency, requests)
  io.write(string.format('{"requests": %d, "seconds": %f, "p50_ms": %f, "p99_ms": %f, "max_ms": %f, "errors": %d}\\n',
    summary.requests, summary.duration / 1e6, latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    latency.max / 1000,
    summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write
      + summary.errors.timeout))
  if count_header ~= "" then
    for _, thread in ipairs(threads) do
      for key, n in pairs(thread:get("counts")) do io.write(string.format("count %s %d\\n", key, n)) end
    end
  end
end
"""


@dataclass(frozen=True)
class WrkRun:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int  # non-2xx answers and socket errors
    cpu_s: float  # wrk's own CPU time
    counts: dict[str, int] = field(default_factory=dict)  # answers by a header's prefix, when asked to count
    max_ms: float = math.nan  # the slowest answer

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def available() -> bool:
    return shutil.which("wrk") is not None


def parse(stdout: str, cpu_s: float) -> WrkRun:
    lines = stdout.splitlines()
    line = next(ln for ln in lines if ln.startswith("{"))
    counts: dict[str, int] = {}
    for ln in lines:
        if ln.startswith("count "):  # one per wrk thread and key: summed
            _, key, n = ln.split(" ")
            counts[key] = counts.get(key, 0) + int(n)
    return WrkRun(**json.loads(line), cpu_s=cpu_s, counts=counts)


def run(url: str, body: dict[str, Any] | None, connections: int, seconds: float, cpus: str | None = None, *,
        threads: int = 1, count_header: str | None = None, prefix: int = 12) -> WrkRun:
    """wrk against ``url`` for ``seconds`` (whole seconds, at least 1): POST ``body`` (``{n}`` numbered) or GET,
    from ``threads`` threads; with ``count_header`` the answers are counted by that header's first ``prefix``
    characters (wrk then reads every answer's headers into Lua: more of its CPU)."""
    if not available():
        raise RuntimeError("wrk is not installed (apt-get install wrk)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(SCRIPT)
    try:
        env = {**os.environ, "BENCH_BODY": json.dumps(body) if body is not None else "",
               "BENCH_COUNT_HEADER": count_header or "", "BENCH_COUNT_PREFIX": str(prefix)}
        argv = [*pinned(cpus), "wrk", "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(seconds))}s",
                "--latency", "-s", f.name, url]
        # The children's account once wrk is reaped: its own CPU time (no other child ends meanwhile).
        before = children_cpu_seconds()
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=seconds + 60, check=False)
        cpu_s = children_cpu_seconds() - before
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip()[:500]}")
    return parse(done.stdout, cpu_s)


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
