"""Chat templates sent in requests: refused unless trusted, and then rendered in sandboxed worker processes.

A request's ``chat_template`` is a program the client runs on the server: three nested loops cost seconds of
CPU, and a short template can render gigabytes. vLLM refuses such requests unless started with
``--trust-request-chat-template``; the gateway does the same, before rendering anything. When trusted, the
template is rendered by ``gateway.guard.counting.template_worker`` in child processes, never in the gateway's
own threads:
each render is bounded in wall time (a timer in the worker, and a kill soon after if it does not answer),
in output characters and in the worker's address space. A fixed number of workers take renders in arrival
order, so costly templates queue among themselves while ordinary chats are counted as before. The rendered
text comes back to be tokenized like any other, so counts stay exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.errors import GatewayError, InvalidRequest
from gateway.guard.counting.chatformat import PreparedChat
from gateway.guard.counting.rendering import named_parameters
from gateway.guard.counting.template_wire import FRAME

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gateway.config import Settings

__all__ = ["RequestTemplates", "TemplateInputs", "TemplateLimits", "TemplateSandbox"]

log = logging.getLogger(__name__)

TRUST_FLAG = "--trust-request-chat-template"
_HEADER_LIMIT = 64 * 1024
# The package's parent directory: the worker runs ``-m gateway.guard.counting.template_worker`` from there.
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class TemplateLimits:
    timeout: float = 1.0  # seconds of wall time per render
    max_chars: int = 4 * 1024 * 1024  # rendered characters
    memory_bytes: int = 512 * 1024 * 1024  # address space a worker may add to what its imports map
    workers: int = 1
    start_timeout: float = 60.0  # a cold start imports transformers: seconds on a busy machine

    @property
    def kill_after(self) -> float:
        """Wall time after which an unanswered render is ended by killing its worker."""
        return self.timeout * 1.5 + 0.25

    @classmethod
    def from_settings(cls, settings: Settings) -> TemplateLimits:
        return cls(
            timeout=settings.request_template_timeout,
            max_chars=settings.request_template_max_chars,
            memory_bytes=settings.request_template_memory_mib * 1024 * 1024,
            workers=settings.request_template_workers,
        )


# -- what is rendered --------------------------------------------------------------------------------
class TemplateInputs:
    """Builds a worker's job so that it renders what ``tokenizer.apply_chat_template(tokenize=False)`` would."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        # apply_chat_template binds these from its keyword arguments; everything else reaches the template.
        self._named = named_parameters(tokenizer)
        self._special_tokens = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str | list)}

    def job(self, template: str, messages: list[Any], prepared: PreparedChat, limits: TemplateLimits) -> bytes:
        """The encoded job; the worker converts ``messages`` for ``template`` itself (content format, roles)."""
        rest = dict(prepared.kwargs)
        named = {k: rest.pop(k) for k in list(rest) if k in self._named}
        # The checks apply_chat_template makes before rendering, with its messages.
        if named.get("continue_final_message") and named.get("add_generation_prompt"):
            raise InvalidRequest(
                "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
                "when you want the model to continue the final message, and add_generation_prompt when you want "
                "to add a header that will prompt it to start a new assistant message instead."
            )
        if named.get("return_assistant_tokens_mask"):
            raise InvalidRequest("`return_assistant_tokens_mask=True` requires `return_dict=True` and `tokenize=True`")
        job = {
            "template": template,
            "messages": messages,
            "tools": prepared.tools,
            "documents": named.get("documents"),
            "add_generation_prompt": named.get("add_generation_prompt", False),
            "continue_final_message": named.get("continue_final_message", False),
            "kwargs": {**self._special_tokens, **rest},
            "max_chars": limits.max_chars,
            "timeout": limits.timeout,
        }
        try:
            return json.dumps(job, ensure_ascii=False).encode("utf-8", "surrogatepass")
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidRequest(f"The request cannot be handed to the template renderer: {exc}") from exc


# -- the workers ---------------------------------------------------------------------------------------
class _Worker:
    """One worker process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self._stdin = proc.stdin
        self._stdout = proc.stdout

    async def read_frame(self, limit: int) -> bytes:
        (size,) = FRAME.unpack(await self._stdout.readexactly(FRAME.size))
        if size > limit:
            raise ConnectionError(f"the template worker sent a frame of {size} bytes, more than {limit}")
        return await self._stdout.readexactly(size)

    async def exchange(self, job: bytes, max_chars: int) -> tuple[dict[str, Any], str | None]:
        self._stdin.write(FRAME.pack(len(job)) + job)
        await self._stdin.drain()
        header = json.loads(await self.read_frame(_HEADER_LIMIT))
        if not isinstance(header, dict):
            raise ConnectionError("the template worker answered without a header")
        text = None
        if header.get("status") == "ok":
            text = (await self.read_frame(4 * max_chars + 4)).decode("utf-8", "surrogatepass")
        return header, text

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def reap(self) -> None:
        self.kill()
        await self.proc.wait()


class _Slot:
    """A place for one worker: started on first use, replaced in the background when killed."""

    def __init__(self, sandbox: TemplateSandbox) -> None:
        self._sandbox = sandbox
        self._worker: _Worker | None = None
        self._starting: asyncio.Task[_Worker] | None = None
        self._dying: list[_Worker] = []  # killed, not yet reaped

    async def worker(self) -> _Worker:
        if self._worker is None:
            if self._starting is None:
                self._starting = asyncio.get_running_loop().create_task(self._sandbox.start_worker())
            try:
                # Shielded: a caller that goes away leaves the start to finish for the next one.
                self._worker = await asyncio.shield(self._starting)
            except asyncio.CancelledError:
                raise
            except BaseException:
                self._starting = None
                raise
            self._starting = None
        return self._worker

    @property
    def alive(self) -> bool:
        return self._worker is not None and self._worker.proc.returncode is None

    def replace(self) -> None:
        old, self._worker = self._worker, None
        if old is not None:
            old.kill()
            self._dying.append(old)
        if not self._sandbox.closed:
            self._starting = asyncio.get_running_loop().create_task(self._restart())

    async def _reap_dying(self) -> None:
        while self._dying:
            await self._dying[0].reap()
            self._dying.pop(0)

    async def _restart(self) -> _Worker:
        await self._reap_dying()
        self._sandbox.restarts += 1
        return await self._sandbox.start_worker()

    async def close(self) -> None:
        if self._starting is not None:
            self._starting.cancel()
            with contextlib.suppress(BaseException):
                self._worker = self._worker or await self._starting
            self._starting = None
        await self._reap_dying()
        if self._worker is not None:
            await self._worker.reap()
            self._worker = None


class TemplateSandbox:
    """Renders jobs in ``limits.workers`` worker processes, one job per worker at a time, in arrival order."""

    def __init__(self, limits: TemplateLimits, command: Sequence[str] | None = None) -> None:
        self.limits = limits
        self._command = list(command or [sys.executable, "-m", "gateway.guard.counting.template_worker"])
        self._command.append(str(limits.memory_bytes))
        self._slots = [_Slot(self) for _ in range(limits.workers)]
        self._free: asyncio.Queue[_Slot] = asyncio.Queue()
        for slot in self._slots:
            self._free.put_nowait(slot)
        self.closed = False
        self.renders = 0  # jobs handed to a worker
        self.busy = 0  # jobs in a worker now
        self.restarts = 0

    async def start_worker(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            *self._command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            cwd=_PACKAGE_ROOT,
            start_new_session=True,  # a Ctrl-C on the terminal is the gateway's to handle, not the worker's
        )
        worker = _Worker(proc)
        try:
            ready = json.loads(await asyncio.wait_for(worker.read_frame(_HEADER_LIMIT), self.limits.start_timeout))
            if not isinstance(ready, dict) or ready.get("status") != "ready":
                raise ConnectionError(f"unexpected first answer {ready!r}")
        except BaseException:
            await asyncio.shield(worker.reap())
            raise
        return worker

    async def render(self, job: bytes) -> str:
        """The rendered text of ``job`` (from ``TemplateInputs.job``); 400 when the template fails or overruns."""
        if self.closed:
            raise GatewayError("The chat template renderer is shut down.")
        slot = await self._free.get()
        try:
            return await self._render_in(slot, job)
        finally:
            self._free.put_nowait(slot)

    async def _render_in(self, slot: _Slot, job: bytes) -> str:
        try:
            worker = await slot.worker()
        except (TimeoutError, OSError, ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            log.error("the chat template worker could not start: %s", exc)
            raise GatewayError(f"The chat template renderer could not start: {exc or type(exc).__name__}") from exc
        self.renders += 1
        self.busy += 1
        answered = False
        try:
            header, text = await asyncio.wait_for(worker.exchange(job, self.limits.max_chars), self.limits.kill_after)
            answered = not header.get("exit")
        except TimeoutError:
            raise self._failure("timeout") from None
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            await asyncio.shield(worker.reap())
            if self.closed:
                raise GatewayError("The chat template renderer was shut down during the render.") from None
            log.warning(
                "the chat template worker failed during a render (exit status %s): %s", worker.proc.returncode, exc
            )
            raise self._failure("died", f"exit status {worker.proc.returncode}") from None
        finally:
            self.busy -= 1
            if not answered:
                # Killed on time, gone, or left mid-answer by a cancelled caller: start a fresh one.
                slot.replace()
        if text is not None:
            return text
        raise self._failure(str(header.get("status")), str(header.get("message", "")))

    def _failure(self, status: str, detail: str = "") -> InvalidRequest:
        limits = self.limits
        if status == "timeout":
            message = (
                f"The request's chat_template took longer than {limits.timeout:g} s to render "
                "(--request-template-timeout); simplify it or leave it out to use the model's own template."
            )
        elif status == "too_large":
            message = (
                f"The request's chat_template rendered more than {limits.max_chars:,} characters "
                "(--request-template-max-chars)."
            )
        elif status == "memory":
            message = (
                f"The request's chat_template needed more than {limits.memory_bytes // (1024 * 1024)} MiB of "
                "memory to render (--request-template-memory-mib)."
            )
        elif status == "died":
            message = f"The request's chat_template stopped its renderer ({detail})."
        else:
            message = detail or "The request's chat_template failed to render."
        return InvalidRequest(message, param="chat_template")

    def live_workers(self) -> int:
        return sum(slot.alive for slot in self._slots)

    async def close(self) -> None:
        self.closed = True
        for slot in self._slots:
            await slot.close()


# -- the policy ----------------------------------------------------------------------------------------
class RequestTemplates:
    """What the gateway does with a chat template sent in a request: refuse it, or render it sandboxed."""

    def __init__(self, trusted: bool, limits: TemplateLimits | None = None, command: Sequence[str] | None = None):
        self.trusted = trusted
        self.limits = limits or TemplateLimits()
        self._command = command
        self._sandbox: TemplateSandbox | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> RequestTemplates:
        return cls(settings.trust_request_chat_template, TemplateLimits.from_settings(settings))

    def requested(self, body: dict[str, Any]) -> str | None:
        """The request's own chat template, or None; 400 unless request templates are trusted."""
        template = body.get("chat_template")
        kwargs = body.get("chat_template_kwargs")
        in_kwargs = isinstance(kwargs, dict) and kwargs.get("chat_template") is not None
        if not self.trusted and (template is not None or in_kwargs):
            raise InvalidRequest(
                "The request carries its own chat template, which runs as code on the server; this gateway "
                f"refuses request templates unless started with {TRUST_FLAG} (vLLM needs the same flag).",
                param="chat_template" if template is not None else "chat_template_kwargs.chat_template",
            )
        if template is not None and not isinstance(template, str):
            raise InvalidRequest("chat_template must be a string", param="chat_template")
        return template

    @property
    def sandbox(self) -> TemplateSandbox:
        if not self.trusted:
            raise RuntimeError("request templates are not trusted: nothing may render them")
        if self._sandbox is None:
            self._sandbox = TemplateSandbox(self.limits, self._command)
        return self._sandbox

    async def close(self) -> None:
        if self._sandbox is not None:
            await self._sandbox.close()
