"""Where a request's CPU goes: py-spy's samples of the gateway's stacks, each assigned to one stage of the path.

A sample inside the pipeline (``gateway/guard/pipeline.py``'s ``handle``) belongs to the first pipeline stage
found from the stack's root: parse, count and plan, tenant limits, the engine's body, admission, the exchange
with the engine. A sample outside it belongs to the first of the HTTP layer's own markers found from the stack's
leaf: the access log, metrics, reading the request, writing the answer, the HTTP server; what is left of the
loop's thread is the event loop's own; other threads (the access log's writer) are counted apart.

py-spy's ``--nonblocking`` samples count a thread that is runnable but waiting for a core as active, its stack
where it stopped: for the loop's thread, just back from ``epoll_wait``, no Python frame, the event loop's. On a
machine whose other work takes the proxy's core now and then, that wait (not CPU) filled most of the event loop's
figure (docs/overhead.md, "Where the event loop's time went"). ``split_cpu`` takes the samples as the loop thread's
time run and waited, and takes the wait, measured from the kernel's schedstat, out of the event loop's figure.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence

# (stage, function name, a piece of its file's path) from the root down, inside the pipeline.
PIPELINE = "handle (gateway/guard/pipeline.py"
EXCHANGE = "exchange_with_engine (gateway/guard/exchange.py"
PIPELINE_STAGES: tuple[tuple[str, str, str], ...] = (
    ("parse and validate", "parse_", "gateway/guard/endpoints/"),
    ("parse and validate", "engine_limits ", "gateway/guard/pipeline.py"),
    ("parse and validate", "refuse_while_", "gateway/guard/pipeline.py"),
    ("count and plan", "plan_generation ", "gateway/guard/planning.py"),
    ("count and plan", "plan_pooling ", "gateway/guard/planning.py"),
    ("tenant limits", "check_tenant_limits ", "gateway/guard/pipeline.py"),
    ("tenant limits", "Grant.settle ", "gateway/tenants/"),
    ("the engine's body", "engine_body ", "gateway/guard/endpoints/base.py"),
    ("the engine's body", "dumps ", "gateway/guard/offload.py"),
)
# (stage, a piece of a frame) from the leaf up, outside the pipeline: tasks and callbacks of their own (the
# counter's, the queue's pump, the upstream connection's reads) and the HTTP layer around the pipeline.
OUTSIDE_STAGES: tuple[tuple[str, str], ...] = (
    ("access log", "gateway/observe/access_log.py"),
    ("access log", "gateway/http/access.py"),
    ("metrics", "gateway/metrics.py"),
    ("metrics", "prometheus_client/"),
    ("count and plan", "gateway/guard/counting/"),
    ("count and plan", "transformers/"),
    ("count and plan", "jinja2/"),
    ("admission: reserve and release", "gateway/admission/"),
    ("exchange with the engine", "gateway/engine/"),
    ("read the request", "read_context "),
    ("write the answer", "gateway/http/relay.py"),
    ("write the answer", "gateway/http/stream_out.py"),
    ("write the answer", "starlette/responses.py"),
    ("HTTP server", "uvicorn/"),
    ("HTTP server", "httptools"),
    ("HTTP server", "gateway/http/"),
)
# Tasks of the gateway's own that no request started: its periodic loops (the engines' scrapes, the live page's
# history), the engines' probes.
BACKGROUND_ROOTS = (
    "gateway/periodic.py", "EngineView.", "gateway/observe/history.py", "gateway/engine/probe", "ProgressDetector.",
)
LOOP = "event loop: sockets, timers"
BACKGROUND = "background tasks (scrapes)"
OTHER_THREADS = "other threads (off the loop)"
ORDER = (
    "HTTP server", "read the request", "parse and validate", "count and plan", "tenant limits", "the engine's body",
    "admission: reserve and release", "exchange with the engine", "write the answer", "access log", "metrics",
    LOOP, BACKGROUND, OTHER_THREADS,
)  # fmt: skip


def stage_of(frames: Sequence[str], loop_thread: bool) -> str:
    """The stage of one sample: ``frames`` root first, as py-spy's raw format writes them."""
    if not loop_thread:
        return OTHER_THREADS
    runner = next((i for i, f in enumerate(frames) if "asyncio/runners.py" in f), None)
    # What the loop runs: empty while it is in its own code (uvloop's sockets and timers). A stack read while the
    # process ran on (py-spy's --nonblocking) may come truncated at its root: then its frames as they came.
    below = list(frames[runner + 1:]) if runner is not None else [f for f in frames if not f.startswith("thread")]
    if not below:
        return LOOP
    if any(marker in below[0] for marker in BACKGROUND_ROOTS):
        return BACKGROUND
    inside = next((i for i, f in enumerate(below) if f.startswith(PIPELINE)), None)
    if inside is not None:
        if any(f.startswith(EXCHANGE) for f in below[inside:]):
            return "exchange with the engine"
        for frame in below[inside + 1:]:
            for stage, name, path in PIPELINE_STAGES:
                if frame.startswith(name) and path in frame:
                    return stage
        return "admission: reserve and release"  # the pipeline's own lines hold the reservation's scope
    for frame in reversed(below):
        for stage, piece in OUTSIDE_STAGES:
            if piece in frame:
                return stage
    return LOOP


def shares(raw_lines: Iterable[str]) -> dict[str, float]:
    """Each stage's share of the samples in py-spy's ``--format raw`` output (``--threads``: each stack starts
    with its thread, the loop's being the main thread, which runs ``asyncio``'s runner)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw_lines:
        stack, _, count = line.strip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        loop_thread = frames[0].endswith(": MainThread") or any("asyncio/runners.py" in f for f in frames)
        counts[stage_of(frames, loop_thread)] += int(count)
    total = sum(counts.values())
    return {s: counts[s] / total for s in ORDER} if total else {}


def split_cpu(stage_shares: Mapping[str, float], ran_s: float, waited_s: float, cpu_s: float,
              units: float) -> dict[str, float]:
    """Each stage's CPU per unit (microseconds). The loop thread's samples stand for its time run and waited
    (``ran_s``, ``waited_s``: its schedstat over the run), the wait is taken out of the event loop's figure (a
    thread woken from ``epoll_wait`` waits there, no Python frame on its stack), and the other threads get the
    process's CPU (``cpu_s``) beyond the loop thread's."""
    if not units:
        return {}
    on_loop = {s: v for s, v in stage_shares.items() if s != OTHER_THREADS}
    total = sum(on_loop.values())
    out = {s: v / total * (ran_s + waited_s) * 1e6 / units for s, v in on_loop.items()} if total else {}
    out[LOOP] = max(0.0, out.get(LOOP, 0.0) - waited_s * 1e6 / units)
    out[OTHER_THREADS] = max(0.0, cpu_s - ran_s) * 1e6 / units
    return out
