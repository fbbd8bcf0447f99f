"""A stand-in for vLLM's API server: prints vLLM's log lines, fails the way vLLM fails, serves
/health, /v1/models, /metrics (with its KV capacity and progress) and answers /v1/completions and
/v1/chat/completions after --fake-request-seconds. Standard library only, so it starts in milliseconds.

Behaviour comes from --fake-* flags; --fake-state-dir counts launches (and records each launch's
argv) so that a scenario can apply to some launches only (--fake-on 1,2).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

V1_ERROR = (
    "ValueError: To serve at least one request with the model's max seq len ({n}), (0.03 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (0.0 GiB). Based on the available memory, "
    "the estimated maximum model length is {est}. Try increasing `gpu_memory_utilization` (which also "
    "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine."
)
V0_ERROR = (
    "ValueError: The model's max seq len ({n}) is larger than the maximum number of tokens that can be "
    "stored in KV cache ({kv}). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
    "when initializing the engine."
)
NO_CACHE = (
    "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
    "initializing the engine."
)
FREE_MEMORY = (
    "ValueError: Free memory on device cuda:0 (10.5/79.19 GiB) on startup is less than desired GPU memory "
    "utilization (0.9, 71.27 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."
)
CUDA_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.19 GiB of which 1.2 GiB is free. Of the allocated memory 70.1 GiB is allocated by PyTorch, and "
    "3.50 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
# vLLM 0.32's answer to requests once its engine is dead.
ENGINE_DEAD_REPLY = (
    b'{"error":{"message":"EngineCore encountered an issue. See stack trace (above) for the root cause.",'
    b'"type":"InternalServerError","param":null,"code":null}}'
)
ENGINE_DEAD = (
    "(APIServer pid=23058) ERROR 11-21 12:52:11 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
    "EngineCore encountered an issue. See stack trace (above) for the root cause."
)


def say(level: str, text: str) -> None:
    print(f"{level} {time.strftime('%m-%d %H:%M:%S')} [fake_vllm.py:1] {text}", flush=True)


ENGINE_CORE = (
    "import ctypes, threading, time; ctypes.CDLL(None).prctl(15, b'VLLM::EngineCor', 0, 0, 0); "
    "threading.Thread(target=time.sleep, args=(3600,), daemon=True).start(); time.sleep(3600)"
)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="fake")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--fake-scenario", default="ok")
    p.add_argument("--fake-on", default="", help="launch numbers the scenario applies to (default: all)")
    p.add_argument("--fake-devices", default=None,
                   help="the scenario applies only to the engine whose CUDA_VISIBLE_DEVICES is this")
    p.add_argument("--fake-state-dir", default=None)
    p.add_argument("--fake-native-len", type=int, default=32768)
    p.add_argument("--fake-kv-tokens", type=int, default=4096)
    p.add_argument("--fake-estimate", type=int, default=3968)
    p.add_argument("--fake-min-util", type=float, default=0.95)
    p.add_argument("--fake-startup-delay", type=float, default=0.0)
    p.add_argument("--fake-hold", default=None, help="start-up waits while this file exists")
    p.add_argument("--fake-after", type=float, default=0.3)
    p.add_argument("--fake-trigger", default=None, help="the scenario's failure waits for this file, not --fake-after")
    p.add_argument("--fake-exit-code", type=int, default=1)
    p.add_argument("--fake-request-seconds", type=float, default=0.05, help="time one completion takes")
    args, _unknown = p.parse_known_args()

    launch = 1
    if args.fake_state_dir:
        state = Path(args.fake_state_dir)
        state.mkdir(parents=True, exist_ok=True)
        counter = state / "launches"
        launch = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(launch))
        (state / f"argv-{launch}.json").write_text(json.dumps(sys.argv[1:]))
        (state / f"pid-{launch}").write_text(str(os.getpid()))
    on = {int(x) for x in args.fake_on.split(",") if x}
    scenario = args.fake_scenario if not on or launch in on else "ok"
    if args.fake_devices is not None and os.environ.get("CUDA_VISIBLE_DEVICES") != args.fake_devices:
        scenario = "ok"

    say("INFO", "Automatically detected platform cpu.")
    say("INFO", f"vLLM API server version 0.32.0 (fake), launch {launch}")
    time.sleep(args.fake_startup_delay)
    while args.fake_hold and Path(args.fake_hold).exists():
        time.sleep(0.02)
    max_len = args.max_model_len or args.fake_native_len

    if scenario == "fit" and max_len > args.fake_estimate:
        print("Traceback (most recent call last):", flush=True)
        print(V1_ERROR.format(n=max_len, est=args.fake_estimate), flush=True)
        return 1
    if scenario == "fit-v0" and max_len > args.fake_kv_tokens:
        print(V0_ERROR.format(n=max_len, kv=args.fake_kv_tokens), flush=True)
        return 1
    if scenario == "no-cache" and args.gpu_memory_utilization < args.fake_min_util - 1e-9:
        print(NO_CACHE, flush=True)
        return 1
    if scenario == "free-memory":
        print(FREE_MEMORY, flush=True)
        return 1
    if scenario == "startup-oom":
        print(CUDA_OOM, flush=True)
        return 1
    if scenario == "crash-at-start":
        print("RuntimeError: something vLLM does not survive", flush=True)
        return int(args.fake_exit_code)
    if scenario == "never-ready":
        time.sleep(3600)
        return 0

    kv_tokens = min(args.fake_kv_tokens, 10**9)
    say("INFO", f"CPU KV cache size: {kv_tokens:,} tokens, Maximum concurrency for {max_len:,} tokens per "
        f"request: {kv_tokens / max_len:.2f}x")
    if scenario in ("grandchild", "engine-core") and args.fake_state_dir:
        # Like vLLM's EngineCore: a second process of the engine that does not watch its parent ("engine-core":
        # named as vLLM names it, with a second thread, as its busy loop has beside its sockets' threads).
        code = ENGINE_CORE if scenario == "engine-core" else "import time; time.sleep(3600)"
        gc = subprocess.Popen([sys.executable, "-c", code])
        (Path(args.fake_state_dir) / f"grandchild-{launch}").write_text(str(gc.pid))

    stalled = scenario == "stall"
    name = args.served_model_name or args.model
    blocks = kv_tokens // args.block_size
    lock = threading.Lock()
    progress = {"running": 0, "generated": 1234}
    engine_dead = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server does

        def do_GET(self) -> None:
            if not self._authorized():
                self._send(401, b'{"error": "Unauthorized"}', "application/json")
            elif self.path == "/health":
                self._send(200, b"", "text/plain")
            elif self.path == "/v1/models":
                body = {"object": "list", "data": [
                    {"id": name, "object": "model", "root": args.model, "max_model_len": max_len}]}
                self._send(200, json.dumps(body).encode(), "application/json")
            elif self.path == "/metrics":
                with lock:
                    running = 1 if stalled else progress["running"]
                    generated = progress["generated"]
                labels = f'model_name="{name}",engine="0"'
                text = (
                    f'vllm:cache_config_info{{block_size="{args.block_size}",num_gpu_blocks="{blocks}",'
                    f'engine="0"}} 1.0\n'
                    f"vllm:num_requests_running{{{labels}}} {running}.0\n"
                    f"vllm:num_requests_waiting{{{labels}}} 0.0\n"
                    f"vllm:kv_cache_usage_perc{{{labels}}} 0.0\n"
                    f"vllm:generation_tokens_total{{{labels}}} {generated}.0\n"
                    f"vllm:num_preemptions_total{{{labels}}} 0.0\n"
                )
                self._send(200, text.encode(), "text/plain; version=0.0.4")
            else:
                self._send(404, b'{"error": "not found"}', "application/json")

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            if not self._authorized():
                self._send(401, b'{"error": "Unauthorized"}', "application/json")
                return
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._send(404, b'{"error": "not found"}', "application/json")
                return
            if engine_dead.is_set():
                self._send(500, ENGINE_DEAD_REPLY, "application/json")
                return
            body = json.loads(raw or b"{}")
            tokens = max(1, int(body.get("max_tokens") or 16))
            with lock:
                progress["running"] += 1
            try:
                time.sleep(args.fake_request_seconds)
            finally:
                with lock:
                    progress["running"] -= 1
                    progress["generated"] += tokens
            text = "ok " * tokens
            chat = self.path == "/v1/chat/completions"
            choice = {"index": 0, "finish_reason": "length"} | (
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            reply = {
                "id": f"fake-{time.monotonic_ns()}", "object": "chat.completion" if chat else "text_completion",
                "model": name, "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1},
            }
            self._send(200, json.dumps(reply).encode(), "application/json")

        def _authorized(self) -> bool:
            return not (args.api_key and self.path.startswith("/v1") and (
                self.headers.get("Authorization") != f"Bearer {args.api_key}"
            ))

        def _send(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *a: object) -> None:
            return  # vLLM's access log would only be noise in the tests

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    say("INFO", f"Starting vLLM API server 0 on http://{args.host}:{args.port}")

    if scenario in {"crash-after", "oom-after", "oom-crash", "engine-dead"}:
        def later() -> None:
            if args.fake_trigger:
                while not Path(args.fake_trigger).exists():
                    time.sleep(0.02)
            else:
                time.sleep(args.fake_after)
            if scenario in {"oom-after", "oom-crash"}:
                print(CUDA_OOM, flush=True)
            if scenario == "engine-dead":
                # vLLM's API server logs its engine's death, fails requests, and only exits later.
                engine_dead.set()
                # Requests fail before the log says why: vLLM prints a long stack trace first.
                time.sleep(0.5)
                print(ENGINE_DEAD, flush=True)
                time.sleep(30)
            if scenario != "oom-after":
                os._exit(args.fake_exit_code)
        threading.Thread(target=later, daemon=True).start()

    server.serve_forever(poll_interval=0.05)
    say("INFO", "Shutting down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
