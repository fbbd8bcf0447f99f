"""The process that renders chat templates sent in requests:
``python -m gateway.guard.counting.template_worker MEMORY_BYTES``.

A request's template is code written by the client. Rendering it here, not in the gateway, keeps its cost
off the gateway's event loop and tokenizer threads: this process limits its own address space
(``RLIMIT_AS``), cuts the output at the job's character cap, and stops a render at the job's timeout with an
interval timer; the gateway kills it outright if it does not answer soon after that.

Protocol, one job at a time: frames of a 4-byte big-endian length and a body, on stdin and a private copy of
stdout (the real stdout goes to stderr, so no stray print can corrupt a frame). The worker first sends
``{"status": "ready"}``. A job is a JSON object (see ``templates.render_job``); the answer is a JSON header
``{"status": "ok"}`` followed by a frame of the rendered text in UTF-8, or ``{"status": <failure>,
"message": str}`` with status ``error``, ``timeout``, ``too_large`` or ``memory``. After a failed allocation
or a too-deep recursion the worker exits (the header says ``"exit": true``), since either may have left it in
any state.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from collections.abc import Iterable
from types import FrameType
from typing import IO, Any

from gateway.guard.counting.template_wire import FRAME, template_error_reason


class RenderTimeout(Exception):
    """Raised by the interval timer inside a render that ran past the job's timeout."""


class OutputTooLarge(Exception):
    """The template rendered more characters than the job allows."""


def read_frame(stream: IO[bytes]) -> bytes | None:
    head = stream.read(FRAME.size)
    if len(head) < FRAME.size:
        return None
    (size,) = FRAME.unpack(head)
    body = stream.read(size)
    return body if len(body) == size else None


def write_frame(stream: IO[bytes], body: bytes) -> None:
    stream.write(FRAME.pack(len(body)) + body)
    stream.flush()


def send(stream: IO[bytes], header: dict[str, Any], text: str | None = None) -> None:
    write_frame(stream, json.dumps(header).encode())
    if text is not None:
        write_frame(stream, text.encode("utf-8", "surrogatepass"))


def limit_address_space(extra_bytes: int) -> None:
    """Allow ``extra_bytes`` of address space beyond what the process maps now (its imports)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:  # no procfs: count from zero, which only makes the limit stricter
        mapped = 0
    limit = mapped + extra_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def capped_concat(max_chars: int) -> Any:
    """A replacement for the environment's ``concat`` that stops once the output passes ``max_chars``."""

    def concat(pieces: Iterable[str]) -> str:
        out: list[str] = []
        total = 0
        for piece in pieces:
            total += len(piece)
            if total > max_chars:
                raise OutputTooLarge
            out.append(piece)
        return "".join(out)

    return concat


class Renderer:
    """Renders jobs as ``tokenizer.apply_chat_template(..., tokenize=False)`` would, with vLLM's message handling."""

    def __init__(self) -> None:
        # Imported before the address-space limit, which is counted from what these map.
        from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

        from gateway.guard.counting.chatformat import convert_messages, developer_to_system
        from gateway.guard.counting.content_format import detect_content_format

        self._compile = _compile_jinja_template
        self._render = render_jinja_template
        self._convert = convert_messages
        self._detect = detect_content_format
        self._developer = developer_to_system
        self._last_template: str | None = None

    def render(self, job: dict[str, Any]) -> str:
        template: str = job["template"]
        if template != self._last_template:
            # Keep only the latest template compiled: clients' templates must not pile up in the caches.
            self._compile.cache_clear()
            self._detect.cache_clear()
            self._last_template = template
        conversation = self._convert(job["messages"], self._detect(template))
        conversation = self._developer(conversation, template)
        compiled = self._compile(template)
        compiled.environment.concat = capped_concat(job["max_chars"])
        # Annotated as returning str; it returns (texts, generation indices).
        rendered: Any = self._render(
            conversations=[conversation],
            tools=job["tools"],
            documents=job["documents"],
            chat_template=template,
            continue_final_message=job["continue_final_message"],
            add_generation_prompt=job["add_generation_prompt"],
            **job["kwargs"],
        )
        text: str = rendered[0][0]
        if len(text) > job["max_chars"]:
            raise OutputTooLarge
        return text


def on_alarm(signum: int, frame: FrameType | None) -> None:
    raise RenderTimeout


def serve_one(renderer: Renderer, frame: bytes, out: IO[bytes]) -> bool:
    """Render one job and answer it; False when the worker exits afterwards (the answer says ``"exit": true``)."""
    try:
        job = json.loads(frame.decode("utf-8", "surrogatepass"))
        signal.setitimer(signal.ITIMER_REAL, float(job["timeout"]))
        try:
            text = renderer.render(job)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except RenderTimeout:
        send(out, {"status": "timeout", "message": "timeout"})
    except OutputTooLarge:
        send(out, {"status": "too_large", "message": "too large"})
    except (MemoryError, RecursionError) as exc:
        # A deep recursion can leave as little memory behind as a failed allocation: start afresh either way.
        status = "memory" if isinstance(exc, MemoryError) else "error"
        send(out, {"status": status, "message": str(exc)[:2000], "exit": True})
        return False
    except Exception as exc:  # templates raise anything; each is the client's 400
        send(out, {"status": "error", "message": template_error_reason(exc)[:2000]})
    else:
        send(out, {"status": "ok"}, text)
    return True


def main(argv: list[str]) -> int:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdin = sys.stdin.buffer
    renderer = Renderer()
    limit_address_space(int(argv[1]))
    signal.signal(signal.SIGALRM, on_alarm)
    send(out, {"status": "ready"})
    while (frame := read_frame(stdin)) is not None:
        if not serve_one(renderer, frame, out):
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
