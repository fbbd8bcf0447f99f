"""What one access-log record costs the event loop: ``AccessLog.write`` as ``vllm-guard serve`` runs it (the
process-wide log redaction installed, the default handler's queue and writer thread, to a pipe read at once).

    .venv/bin/python bench/access_log_cost.py [--format text|json] [--runs 3]

Three records: an ordinary one, and the same refused with a model name of 1 MiB and of 8 MiB (a client's, under
the default --max-body-bytes). Prints the caller's time per record, each run.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.observe.access_log import AccessLog, AccessLogFormat, AccessRecord, install_default_handler
from gateway.redact import SecretRedactor, install_log_redaction

RECORD = AccessRecord(
    time=1_795_000_000.25, request_id="0a1b2c3d4e5f00000001", tenant="team-a", route="chat",
    model="Qwen/Qwen2.5-0.5B-Instruct", status=200, outcome="ok", reason=None, prompt_tokens=12,
    max_tokens_asked=4000, max_tokens=2036, truncated_tokens=0, queue_ms=1.26, engine="0", ttft_ms=15.04,
    duration_ms=40.0, completion_tokens=7, trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
)
CASES = [
    ("ordinary", RECORD, 10_000),
    ("1 MiB model", replace(RECORD, model="x" * (1 << 20), status=404, outcome="refused"), 20),
    ("8 MiB model", replace(RECORD, model="m\u00e9" * (4 << 20), status=404, outcome="refused"), 10),
]


def drained_pipe() -> int:
    """The write end of a pipe whose read end a thread empties as fast as it can."""
    read, write = os.pipe()

    def drain() -> None:
        while os.read(read, 1 << 20):
            pass

    threading.Thread(target=drain, daemon=True).start()
    return write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", choices=["text", "json"], default="text")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    fmt: AccessLogFormat = args.format
    install_log_redaction(SecretRedactor(["sk-some-configured-key-0123"]))
    handler = install_default_handler(fmt, os.fdopen(drained_pipe(), "w", buffering=1 << 16))
    log = AccessLog(fmt)
    try:
        for name, record, count in CASES:
            runs = []
            for _ in range(args.runs):
                started = time.perf_counter()
                for _ in range(count):
                    log.write(record)
                runs.append((time.perf_counter() - started) / count)
                time.sleep(0.2)  # the writer thread catches up between runs
            print(f"{fmt} {name}: " + ", ".join(f"{seconds * 1e6:.0f} us" for seconds in runs) + " a record")
    finally:
        if handler is not None:
            handler.stop()


if __name__ == "__main__":
    main()
