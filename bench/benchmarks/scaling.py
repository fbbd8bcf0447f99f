"""How far ``--workers N`` scales: chats/s and relayed tokens/s at each N, and from each process's CPU and the
requests it served, the authority's coordination per request against a worker's whole cost, and the Amdahl
bound they set.

    python -m bench run scaling [--workers-list 1,2,3] [--load chats --load streams] [--seconds 8] \
        [--authority serving --authority apart]
    python -m bench run scaling --workers-list 1,2,4,8 --gateway-cpus 0-7 --engine-cpus 8-11 --client-cpus 12-15 \\
        --engine-processes 4 --client-threads 4 --stream-clients 4        # a 16-core machine: bench/device/scaling.sh

For each N of ``--workers-list`` the gateway starts with ``--workers N`` on the first N of the proxies' cores (all
of them share core 1 on a 2-core machine: the per-process figures hold, the rates do not scale there), in front
of the fast fake engine (``--engine-processes`` serve its port), and gets, per load:

- ``chats``: short chats (the overhead benchmark's), ``--connections`` at a time (64) from wrk;
- ``streams``: ``--stream-load`` (128 streams of 200 tokens at 20 ms a token) from the relay benchmark's client
  (``--stream-clients`` processes share the streams), asking for the final usage.

Past one process, each N runs with the admission authority serving (one of the N) and apart (``--authority
apart``: N workers and the authority, which serves nothing; figures named ``..._apart``), in turns on the same
loads.

Which process served what: each gateway process writes a request id prefix of its own in its answers'
``x-request-id``; before the loads, probe connections find each process's prefix (the process that holds the
server side of the connection, from /proc), and during a load wrk (and the stream client) count answers by prefix.
Each process's CPU is its own (every thread, from /proc/<pid>/stat) over the load. ``bench.workloads.scaling``
turns these into a worker's cost per unit ``w``, the authority's coordination per unit a worker served ``c`` (its
CPU beyond its own serving, priced at ``w``), and the bound of ``M`` processes at ``M / (w + (M - 1) c)`` units a
second; the limit ``w1 / c``, one process's cost over the coordination's, is the most any number of workers can
give. With the authority apart, it is first watched ``--idle-seconds`` (10) with nothing sent: its CPU a second
then (its engine scrapes, the workers' state, its probes) is in every ``c``, whatever the load, and is reported
beside it with ``c / w`` less that work over the load's seconds. Per-process figures are in the table after the
result's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import statistics
import subprocess
import time
from typing import Any
from urllib.parse import urlsplit

from bench.benchmarks import relay
from bench.harness.context import Context
from bench.harness.cpu import own_seconds
from bench.harness.pairing import Figures, in_turns
from bench.harness.processes import cpu_list, pinned, python
from bench.harness.results import Measure, Result
from bench.harness.target import Target
from bench.targets import engines, proxies
from bench.workloads import scaling, wrk
from bench.workloads.streams import ID_PREFIX

SUMMARY = "--workers N: chats/s and tokens/s per N, each process's CPU per request served, the Amdahl bound"
TARGETS = ["gateway", "baseline"]
DEFAULT_TARGETS = ["gateway"]
GATEWAY_FLAGS = ("--log-level", "warning", "--max-queue", "10000")
LOADS = ("chats", "streams")
AUTHORITY = ("serving", "apart")
AMDAHL_AT = (8, 16)


def worker_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers-list is numbers with commas (1,2,4,8), got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--workers-list needs numbers of 1 or more, got {text!r}")
    return sorted(set(counts))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(seconds=8.0, repeat=1)
    parser.add_argument("--workers-list", type=worker_counts, default=[1, 2, 3], help="N of --workers to run (1,2,3)")
    parser.add_argument("--load", action="append", choices=LOADS, default=None, help="repeatable; default both")
    parser.add_argument("--connections", type=int, default=64, help="chats at a time (64)")
    parser.add_argument("--stream-load", type=relay.load_spec, default=relay.Load(128, 200, 0.02),
                        help="STREAMSxTOKENS@SECONDS_A_TOKEN of the streams load (128x200@0.02)")
    parser.add_argument("--engine-processes", type=int, default=1, help="processes of the fake engine (1)")
    parser.add_argument("--client-threads", type=int, default=1, help="wrk's threads (1)")
    parser.add_argument("--stream-clients", type=int, default=1, help="stream client processes (1)")
    parser.add_argument("--authority", action="append", choices=AUTHORITY, default=None,
                        help="repeatable: the authority's modes past one process (default both)")
    parser.add_argument("--idle-seconds", type=float, default=10.0,
                        help="seconds the authority apart is watched with nothing sent, before the loads (10; 0: not)")


def configurations(counts: list[int], modes: list[str]) -> list[tuple[int, str]]:
    """Each (N, the authority's mode) to run, ascending in N: ``--workers 1`` has no authority to set apart."""
    return [(n, "serving") if n == 1 else (n, mode) for n in counts for mode in (modes if n > 1 else ["serving"])]


def key_of(load: str, n: int, mode: str) -> str:
    return f"{load}_w{n}" + ("_apart" if mode == "apart" else "")


def measures(counts: list[int], loads: list[str], modes: list[str]) -> list[Measure]:
    out: list[Measure] = []
    for ld in loads:
        unit = "token" if ld == "streams" else "chat"
        for n, mode in configurations(counts, modes):
            k, at = key_of(ld, n, mode), f", {ld}, --workers {n}" + (", authority apart" if mode == "apart" else "")
            out += [Measure(f"{k}_rate", f"{unit}s/s{at}", ".0f"),
                    Measure(f"{k}_cpu_us", f"all processes' CPU per {unit} (us){at}", ".1f")]
            if n > 1:
                out += [Measure(f"{k}_authority_share", f"share the authority served{at}", ".2f"),
                        Measure(f"{k}_authority_us", f"authority's CPU per {unit} of the whole (us){at}", ".1f"),
                        Measure(f"{k}_worker_us", f"w: a worker's CPU per {unit} it served (us){at}", ".1f"),
                        Measure(f"{k}_coord_us", f"c: coordination per {unit} a worker served (us){at}", ".1f"),
                        Measure(f"{k}_coord_of_worker", f"c / w{at}", ".3f"),
                        *((Measure(f"{k}_authority_idle_ms", f"authority's CPU a second with nothing sent (ms){at}",
                                   ".1f"),
                           Measure(f"{k}_coord_beyond_idle_of_worker", f"c / w less the authority's idle work{at}",
                                   ".3f")) if mode == "apart" else ()),
                        Measure(f"{k}_limit", f"Amdahl limit w1 / c (x one process){at}", ".2f"),
                        *(Measure(f"{k}_bound{m}", f"bound with {m} processes, {unit}s/s{at}", ".0f")
                          for m in AMDAHL_AT)]  # fmt: skip
        out.append(Measure(f"{ld}_failed", f"errors, failed streams ({ld})", ".0f", "none", "sum"))
    return out


def cores_for(ctx: Context, n: int) -> str | None:
    """The first ``n`` of the proxies' cores (all of them when there are fewer)."""
    if not ctx.cores.proxy:
        return None
    cores = sorted(cpu_list(ctx.cores.proxy))
    return ",".join(map(str, cores[:n])) if len(cores) >= n else ctx.cores.proxy


def workers_of(gateway: Target, n: int, timeout_s: float = 180.0) -> list[int]:
    """The pids of the gateway's ``n`` worker processes, once each listens on the gateway's port (a worker
    still importing takes no connection: a load started then goes to the others alone). Where /proc does not
    show sockets (a sandboxed kernel), once they run and 15 s more."""
    import psutil

    port = urlsplit(gateway.url).port
    started, deadline = time.monotonic(), time.monotonic() + timeout_s
    while True:
        found = [c for c in psutil.Process(gateway.pid).children()
                 if "gateway.http.worker_main" in " ".join(c.cmdline())]  # fmt: skip
        listening = [c.pid for c in found if listens(c.pid, port)]
        if len(listening) >= n:
            return sorted(listening)
        if len(found) >= n and not listens(gateway.pid, port) and time.monotonic() - started > 15:
            return sorted(c.pid for c in found)  # the authority's own socket is not seen either: no way to tell
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{gateway.name}: {len(listening)} of {n} workers listening after {timeout_s:.0f} s")
        time.sleep(0.5)


def listens(pid: int, port: int | None) -> bool:
    import psutil

    try:
        return any(conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
                   for conn in psutil.Process(pid).net_connections(kind="tcp"))  # fmt: skip
    except (psutil.Error, OSError):
        return False


def owner(pids: list[int], server_port: int, client_port: int) -> int | None:
    """Which of ``pids`` holds the server side of the connection from ``client_port``."""
    import psutil

    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except (psutil.Error, OSError):
            continue
        for conn in conns:
            if conn.laddr and conn.laddr.port == server_port and conn.raddr and conn.raddr.port == client_port:
                return pid
    return None


def prefixes(gateway: Target, pids: list[int], tries: int = 400) -> dict[int, str]:
    """Each process's request id prefix: a chat on a fresh connection at a time, until every process answered
    one (the kernel picks the process of each connection)."""
    url = urlsplit(gateway.url)
    found: dict[int, str] = {}
    body = json.dumps(wrk.SHORT_CHAT).replace("{n}", "probe")
    for _ in range(tries):
        if len(found) == len(pids):
            break
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=30)
        try:
            conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            rid = answer.getheader("x-request-id") or ""
            pid = owner(pids, url.port or 80, conn.sock.getsockname()[1]) if conn.sock is not None else None
        finally:
            conn.close()
        if pid is not None and answer.status == 200 and len(rid) > ID_PREFIX:
            found[pid] = rid[:ID_PREFIX]
        elif answer.status != 200:
            time.sleep(0.1)  # a worker refusing while its authority is starved of CPU: later
    return found


def streams(ctx: Context, target: Target, load: relay.Load) -> dict[str, Any]:
    """The relay benchmark's stream client, in ``--stream-clients`` processes sharing the streams; their
    results added up (time to first byte: the median of their medians)."""
    k = max(1, ctx.args.stream_clients)
    argv = [*pinned(ctx.cores.client), *python(
        "bench.workloads.streams", "--url", target.url, "--streams", str(max(1, load.streams // k)),
        "--tokens", str(load.tokens), "--token-delay", f"{load.token_delay:g}", "--seconds", f"{ctx.args.seconds:g}",
        "--usage", "final")]  # fmt: skip
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(k)]
    limit = ctx.args.seconds + load.tokens * load.token_delay * 4 + 120
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=limit)
        if p.returncode != 0:
            raise RuntimeError(f"a stream client failed against {target.name}: {err[-2000:]}")
        outs.append(json.loads(out))
    by_prefix: dict[str, int] = {}
    for o in outs:
        for key, n in o["by_prefix"].items():
            by_prefix[key] = by_prefix.get(key, 0) + n
    return {"tokens": sum(o["tokens"] for o in outs), "failed": sum(o["failed"] for o in outs),
            "wall_s": max(o["wall_s"] for o in outs), "by_prefix": by_prefix,
            "ttfb_p50_ms": statistics.median(o["ttfb_p50_ms"] for o in outs)}


def one_load(ctx: Context, gateway: Target, load: str, roles: dict[str, int],
             ids: dict[int, str]) -> tuple[float, float, float, list[scaling.Process], float]:
    """One load against a gateway: units a second, errors or failed streams, units counted (with an id or not),
    each process's CPU and units served, and the load's seconds."""
    before = {name: own_seconds(pid) for name, pid in roles.items()}
    started = time.monotonic()
    if load == "chats":
        done = wrk.run(gateway.url + "/v1/chat/completions", wrk.SHORT_CHAT, ctx.args.connections, ctx.args.seconds,
                       ctx.cores.client, threads=ctx.args.client_threads, count_header="x-request-id", prefix=ID_PREFIX)
        counts, rate, failed = dict(done.counts), done.per_second, float(done.errors)
    else:
        seen = streams(ctx, gateway, ctx.args.stream_load)
        counts, failed = seen["by_prefix"], float(seen["failed"])
        rate = seen["tokens"] / seen["wall_s"] if seen["wall_s"] else math.nan
    spent = {name: own_seconds(pid) - before[name] for name, pid in roles.items()}
    seconds = time.monotonic() - started
    served = scaling.served_by({name: ids.get(pid, "?") for name, pid in roles.items()}, counts)
    procs = [scaling.Process(name, spent[name], served[name]) for name in roles]
    return rate, failed, float(sum(counts.values())), procs, seconds


def idle_per_s(pid: int, seconds: float) -> float:
    """CPU seconds a second the process ``pid`` spends over ``seconds`` with nothing sent (NaN for 0 s): the
    authority apart's scrapes, the workers' state, its probes, in every ``c / w`` whatever the load."""
    if seconds <= 0:
        return math.nan
    before, started = own_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (own_seconds(pid) - before) / (time.monotonic() - started)


def figures_of(load: str, n: int, rate: float, procs: list[scaling.Process], one_us: float | None,
               mode: str = "serving", idle: tuple[float, float] | None = None) -> Figures:
    """One load's figures at ``--workers n``: the rate, the CPU per unit, and past one process the split and
    the Amdahl bounds (``one_us``: one process's CPU per unit, measured at ``--workers 1``; ``mode``: the
    authority's; ``idle``, apart: the authority's CPU seconds a second with nothing sent, and the load's
    seconds)."""
    k, total = key_of(load, n, mode), sum(p.served for p in procs)
    out: Figures = {f"{k}_rate": rate,
                    f"{k}_cpu_us": sum(p.cpu_s for p in procs) * 1e6 / total if total else math.nan}
    if n == 1:
        return out
    # The authority's own serving is priced at the same run's worker cost: a stream's cost per token follows the
    # load (events coalesce in a read when a core is busy), so one process's, from another run, is off (it made
    # the coordination negative on a busy machine). A worker's includes its side of the channel: c is then a
    # little low, by that side's share.
    found = scaling.split(procs)
    w, c = found.worker_us, found.coordination_us
    w1 = one_us if one_us is not None and not math.isnan(one_us) else w
    out |= {f"{k}_authority_share": found.authority_share, f"{k}_authority_us": found.authority_us,
            f"{k}_worker_us": w, f"{k}_coord_us": c, f"{k}_coord_of_worker": found.coordination_of_worker,
            f"{k}_limit": scaling.limit(w1, c),
            **{f"{k}_bound{m}": scaling.bound_apart(m, w, c) if mode == "apart" else scaling.bound_per_s(m, w, w, c)
               for m in AMDAHL_AT}}
    if mode == "apart":
        per_s, seconds = idle if idle is not None else (math.nan, math.nan)
        authority = next((p for p in procs if p.is_authority), None)
        served_w = sum(p.served for p in procs if not p.is_authority)
        out |= {f"{k}_authority_idle_ms": per_s * 1e3,
                f"{k}_coord_beyond_idle_of_worker": scaling.beyond_idle(
                    authority.cpu_s if authority is not None else math.nan, per_s, seconds, served_w, w)}
    return out


def rows_of(where: str, load: str, roles: dict[str, int], procs: list[scaling.Process], counted: float) -> list[str]:
    """The per-process table's rows of one load (``where``: the target, turn and N's cells)."""
    unit = "token" if load == "streams" else "chat"
    rows = [f"| {where} | {load} | {p.name} | {roles[p.name]} | {p.served:.0f} | {p.cpu_s:.2f} | "
            f"{p.cpu_s * 1e6 / p.served if p.served else math.nan:.0f} us a {unit} served |" for p in procs]
    unknown = counted - sum(p.served for p in procs)
    if unknown > 0:  # answers without a known process's prefix (refusals written before an id, a probe missed)
        rows.append(f"| {where} | {load} | (no known prefix) | | {unknown:.0f} | | |")
    return rows


def knows_authority(commit: str) -> bool:
    """Whether the gateway of ``commit`` has ``--authority`` (serving or apart)."""
    config = proxies.source_at(commit)[0] / "gateway" / "config_http.py"
    return config.is_file() and "def authority_apart" in config.read_text()


def run(ctx: Context) -> Result:
    args = ctx.args
    loads = args.load or list(LOADS)
    modes = args.authority or list(AUTHORITY)
    engine = engines.fake(ctx, "engine", token_delay=0.0, processes=args.engine_processes)
    ctx.start(engine)
    tok = proxies.tokenizer_dir()
    table: list[str] = []

    # A baseline commit from before --authority: its authority always serves, and is told no mode.
    modes_of = {"gateway": True, "baseline": "baseline" in args.targets and knows_authority(args.baseline_commit)}

    def measure(name: str, turn: int) -> Figures:
        figures: Figures = {}
        commit = args.baseline_commit if name == "baseline" else None
        for n, mode in configurations(args.workers_list, modes):  # ascending: --workers 1 prices one process first
            apart = mode == "apart"
            if apart and not modes_of[name]:
                continue
            # This tree's authority is set apart by default from 3 workers on: the mode is always said.
            chosen = ("--authority", mode) if modes_of[name] and n > 1 else ()
            gw = proxies.gateway(ctx, f"{name}-w{n}" + ("-apart" if apart else ""), [engine],
                                 flags=(*GATEWAY_FLAGS, "--workers", str(n), *chosen), tokenizer=tok, commit=commit,
                                 cpus=cores_for(ctx, n))
            ctx.start(gw)
            try:
                workers = workers_of(gw, n if apart else n - 1)
                pids = [gw.pid, *workers]
                roles = {"authority": pids[0], **{f"worker {i}": p for i, p in enumerate(workers, 1)}}
                wrk.run(gw.url + "/v1/chat/completions", wrk.SHORT_CHAT, 8, 2.0, ctx.cores.client)  # warm-up
                serving = workers if apart else pids
                ids = prefixes(gw, serving)
                if len(ids) < len(serving):
                    ctx.say(f"{gw.name}: request id prefixes of {len(ids)} of {len(serving)} processes found")
                idle = idle_per_s(roles["authority"], args.idle_seconds) if apart else math.nan
                for load in loads:
                    rate, failed, counted, procs, seconds = one_load(ctx, gw, load, roles, ids)
                    got = figures_of(load, n, rate, procs, figures.get(f"{load}_w1_cpu_us"), mode, (idle, seconds))
                    figures |= got
                    figures[f"{load}_failed"] = figures.get(f"{load}_failed", 0.0) + failed
                    table.extend(rows_of(f"{name} (turn {turn + 1}) | {n}{' apart' if apart else ''}", load, roles,
                                         procs, counted))
                    ctx.say(f"{name} --workers {n} {load}: " + ", ".join(f"{k} {v:.4g}" for k, v in got.items()))
            finally:
                ctx.stop(gw.name)
        return figures

    runs = in_turns(args.targets, args.repeat, measure)
    head = ("| target | N | load | process | pid | served | CPU s | CPU per unit it served |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- |")
    notes = [f"cores: gateway --workers N on the first N of {ctx.cores.proxy or 'any'}; engine "
             f"{ctx.cores.engine or 'any'} ({args.engine_processes} process(es)); load {ctx.cores.client or 'any'}",
             f"chats: {args.connections} at a time from wrk ({args.client_threads} thread(s)); streams: "
             f"{args.stream_load.label} from {args.stream_clients} client process(es); {args.seconds:g} s a load",
             "w: a worker's CPU per unit it served; w1: one process's (--workers 1); c: the authority's CPU beyond "
             "its own serving (priced at w) per unit a worker served (apart: its whole CPU); bound with M processes "
             "= M / (w + (M - 1) c), apart (M workers and the authority on M cores) min(M / (w + c), 1 / c); "
             "limit (the speed-up over one process no number of workers passes) = w1 / c"]
    return ctx.result(measures(args.workers_list, loads, modes), runs, ["baseline"], notes=notes,
                      extra_markdown="Each process over each load:\n\n" + head + "\n" + "\n".join(table))
