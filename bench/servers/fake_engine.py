"""A fast fake vLLM: answers at once, or streams one SSE event per token, for measuring what a proxy costs.

    python -m bench.servers.fake_engine --port 8000 [--token-delay 0.02] [--model tiny] [--max-model-len 32768]
        [--processes N]

A raw asyncio protocol with httptools on uvloop, no web framework, so that the engine side of a benchmark costs
little of the core it shares with the load generator (it answers some 30,000 short chats a second on one core;
``python -m bench run fake-engine`` measures it). What it serves, in vLLM 0.32's shapes (the simulator's
``testing/vllm_sim/wire.py`` and ``tests/bench/test_fake_engine.py`` hold them to the same bytes):

- ``POST /v1/chat/completions`` and ``/v1/completions``: without ``stream`` the whole answer at once; with it one
  event per token, ``--token-delay`` seconds apart (or the request's own ``fake_token_delay``, a field of this
  engine's only: one engine serves the relay benchmark's streams of every pace), the chat's role delta first,
  ``data: [DONE]`` last. With
  ``stream_options.continuous_usage_stats`` every chunk carries the running usage; with ``include_usage`` a final
  usage-only chunk follows. An answer runs to ``max_tokens`` (16 when absent), or stops after ``min_tokens`` + 1
  when the request biases a token (``logit_bias``: the realistic benchmarks' way of ending an answer early);
  the request's own ``fake_token_bytes`` makes each streamed token's text that many bytes (the slow-readers
  benchmark fills held answers fast with it);
- ``GET /v1/models`` (``--max-model-len``), ``/health``, ``/version`` and ``/metrics``: a minimal vLLM page whose
  ``vllm:cache_config_info`` says a million blocks, so that a gateway in front never waits for room.

Prompt tokens are not counted (no tokenizer): usage says a quarter of the body's bytes. One choice per request.
``--processes N`` serves the port from N processes (``SO_REUSEPORT``: the kernel spreads the connections), for a
machine where one core of engine would bind before the proxy measured; each keeps its own counters.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from typing import Any

import httptools
import orjson

# The simulator's words (testing/vllm_sim/wire.py), one per token, so that both stream the same text.
WORDS = tuple(w.encode() for w in (
    "the ", "quick ", "brown ", "fox ", "jumps ", "over ", "a ", "lazy ", "dog ", "while ", "tokens ", "stream ",
    "out ", "of ", "the ", "simulated ", "engine ", "one ", "step ", "at ", "a ", "time "))  # fmt: skip
BLOCKS = 1_000_000
DEFAULT_MAX_TOKENS = 16
_JSON = b"application/json"


def token_text(start: int, end: int) -> bytes:
    return b"".join(WORDS[i % len(WORDS)] for i in range(start, end))


class Engine:
    """What the connections share: the settings, the counters /metrics shows, the second-resolution clock."""

    def __init__(self, model: str, max_model_len: int, token_delay: float, version: str = "0.32.0") -> None:
        self.model = model
        self.model_json = orjson.dumps(model)
        self.max_model_len = max_model_len
        self.token_delay = token_delay
        self.version = version
        self.ids = itertools.count(1)
        self.running = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests = 0
        self.wholes: dict[tuple[bool, int, int, bytes], bytes] = {}
        self._second = 0
        self._created = b"0"

    def created(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second, self._created = now, str(now).encode()
        return self._created

    def models(self) -> bytes:
        now = int(time.time())
        card = {"id": self.model, "object": "model", "created": now, "owned_by": "vllm", "root": self.model,
                "parent": None, "max_model_len": self.max_model_len, "permission": []}
        return orjson.dumps({"object": "list", "data": [card]})

    def metrics(self) -> bytes:
        labels = f'engine="0",model_name="{self.model}"'
        rows = [
            ("vllm:num_requests_running", "gauge", self.running),
            ("vllm:num_requests_waiting", "gauge", 0),
            ("vllm:kv_cache_usage_perc", "gauge", 0),
            ("vllm:num_preemptions_total", "counter", 0),
            ("vllm:prompt_tokens_total", "counter", self.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", self.generation_tokens),
            ("vllm:request_success_total", "counter", self.requests),
        ]
        lines = []
        for name, kind, value in rows:
            family = name.removesuffix("_total") if kind == "counter" else name
            lines += [f"# HELP {family} {family}", f"# TYPE {family} {kind}", f"{name}{{{labels}}} {float(value)}"]
        info = (f'block_size="16",num_gpu_blocks="{BLOCKS + 1}",kv_cache_size_tokens="{(BLOCKS + 1) * 16}",'
                f'enable_prefix_caching="False",gpu_memory_utilization="0.92",engine="0"')
        lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                  "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{info}}} 1.0"]
        return ("\n".join(lines) + "\n").encode()


class Answer:
    """One generation request as read from its body."""

    __slots__ = ("chat", "continuous", "delay", "final", "finish", "head", "n", "pad", "prompt", "stream")

    def __init__(self, engine: Engine, chat: bool, body: bytes) -> None:
        req = orjson.loads(body) if body else {}
        if not isinstance(req, dict):
            raise ValueError("the body is not a JSON object")
        self.chat = chat
        n = int(req.get("max_tokens") or req.get("max_completion_tokens") or DEFAULT_MAX_TOKENS)
        self.finish = b'"length"'
        if req.get("logit_bias") and isinstance(req.get("min_tokens"), int) and req["min_tokens"] + 1 < n:
            n, self.finish = req["min_tokens"] + 1, b'"stop"'  # the biased token (EOS) as soon as min_tokens allow
        self.n = max(1, n)
        self.stream = bool(req.get("stream"))
        delay = req.get("fake_token_delay")
        self.delay = float(delay) if isinstance(delay, (int, float)) and delay >= 0 else engine.token_delay
        pad = req.get("fake_token_bytes")
        self.pad = min(int(pad), 1 << 20) if isinstance(pad, int) and pad > 0 else 0
        options = req.get("stream_options") or {}
        self.final = bool(options.get("include_usage"))
        self.continuous = self.final and bool(options.get("continuous_usage_stats"))
        self.prompt = max(1, len(body) // 4)
        kind = b"chat.completion" if chat else b"text_completion"
        prefix = b"chatcmpl-" if chat else b"cmpl-"
        self.head = b'{"id":"%s%x","object":"%s%s","created":%s,"model":%s' % (
            prefix, next(engine.ids), kind, b".chunk" if chat and self.stream else b"", engine.created(),
            engine.model_json)

    def usage(self, completion: int) -> bytes:
        return b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}' % (
            self.prompt, self.prompt + completion, completion)

    def whole(self, cache: dict[tuple[bool, int, int, bytes], bytes]) -> bytes:
        """The non-streamed answer, every field vLLM's ``model_dump()`` writes (all but the head cached)."""
        key = (self.chat, self.n, self.prompt, self.finish)
        rest = cache.get(key)
        if rest is None:
            if len(cache) > 4096:
                cache.clear()
            rest = cache[key] = self._rest()
        return self.head + rest

    def _rest(self) -> bytes:
        text = orjson.dumps(token_text(0, self.n).decode())
        usage = self.usage(self.n)[:-1] + b',"prompt_tokens_details":null,"completion_tokens_details":null}'
        if self.chat:
            choice = (b'{"index":0,"message":{"role":"assistant","content":%s,"refusal":null,"annotations":null,'
                      b'"audio":null,"function_call":null,"reasoning":null},"logprobs":null,"finish_reason":%s,'
                      b'"stop_reason":null,"token_ids":null,"routed_experts":null}' % (text, self.finish))
            tail = (b',"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null,"kv_transfer_params":null,'
                    b'"ec_transfer_params":null,"metrics":null}')
        else:
            choice = (b'{"index":0,"text":%s,"logprobs":null,"finish_reason":%s,"stop_reason":null,'
                      b'"token_ids":null,"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null}' % (
                          text, self.finish))
            tail = b',"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
        return (b',"choices":[%s],"service_tier":null,"system_fingerprint":null,"usage":%s' % (
            choice, usage) + tail)

    def first(self) -> bytes:
        """The chat's role delta, sent with the first token's output as vLLM does."""
        usage = b',"usage":' + self.usage(0) if self.continuous else b""
        return (b"data: " + self.head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                b'"logprobs":null,"finish_reason":null}]' + usage + b',"prompt_token_ids":null,"prompt_text":null}\n\n')

    def token(self, i: int) -> bytes:
        """The event of token ``i`` (0-based); the last one says why the answer ended."""
        last = i == self.n - 1
        text = WORDS[i % len(WORDS)]
        if self.pad:
            text = (text * (self.pad // len(text) + 1))[: self.pad]
        finish = self.finish if last else b"null"
        if self.chat:
            stop = b',"stop_reason":null' if last else b""
            choice = b'{"index":0,"delta":{"content":"%s"},"logprobs":null,"finish_reason":%s%s,"token_ids":null}' % (
                text, finish, stop)
        else:
            choice = (b'{"index":0,"text":"%s","logprobs":null,"finish_reason":%s,"stop_reason":null,'
                      b'"prompt_token_ids":null,"token_ids":null}' % (text, finish))
        usage = b',"usage":' + self.usage(i + 1) if self.continuous else b""
        return b"data: " + self.head + b',"choices":[' + choice + b"]" + usage + b"}\n\n"

    def usage_chunk(self) -> bytes:
        return b"data: " + self.head + b',"choices":[],"usage":' + self.usage(self.n) + b"}\n\n"


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Stream:
    """One streamed answer: a timer callback per token, no task (cheaper than a coroutine's sleep per token)."""

    __slots__ = ("answer", "conn", "due", "engine", "i", "loop")

    def __init__(self, conn: Connection, answer: Answer) -> None:
        self.conn, self.answer, self.engine = conn, answer, conn.engine
        self.loop = asyncio.get_running_loop()
        self.i = 0
        self.due = self.loop.time()

    def start(self) -> None:
        self.engine.running += 1
        self.engine.prompt_tokens += self.answer.prompt
        self.conn.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                                  b"transfer-encoding: chunked\r\n\r\n")
        self.tick()

    def tick(self) -> None:
        transport, answer = self.conn.transport, self.answer
        if transport.is_closing():
            self.engine.running -= 1
            return
        event = chunked(answer.token(self.i))
        # One chunk per SSE event, as vLLM's server writes them; the chat's role delta comes with the first token.
        transport.write(chunked(answer.first()) + event if self.i == 0 and answer.chat else event)
        self.i += 1
        self.engine.generation_tokens += 1
        if self.i < answer.n:
            self.due += answer.delay
            self.loop.call_at(self.due, self.tick)
            return
        tail = chunked(answer.usage_chunk()) if answer.final else b""
        transport.write(tail + chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        self.engine.running -= 1
        self.engine.requests += 1
        self.conn.done()


class Connection(asyncio.Protocol):
    """One client connection: httptools parses, each complete request is answered in order."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.url = b""
        self.body: list[bytes] = []
        self.keep_alive = True

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, ValueError):
            self.reply(b"400 Bad Request", b'{"error":{"message":"bad request","code":400}}')
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        path = self.url.split(b"?", 1)[0]
        if path in (b"/v1/chat/completions", b"/v1/completions"):
            try:
                answer = Answer(self.engine, path == b"/v1/chat/completions", b"".join(self.body))
            except ValueError as exc:
                msg = orjson.dumps({"error": {"message": str(exc), "type": "BadRequestError", "code": 400}})
                self.reply(b"400 Bad Request", msg)
                return
            if answer.stream:
                Stream(self, answer).start()
                return
            self.engine.requests += 1
            self.engine.prompt_tokens += answer.prompt
            self.engine.generation_tokens += answer.n
            self.reply(b"200 OK", answer.whole(self.engine.wholes))
        elif path == b"/health":
            self.reply(b"200 OK", b"", b"")
        elif path == b"/v1/models":
            self.reply(b"200 OK", self.engine.models())
        elif path == b"/metrics":
            self.reply(b"200 OK", self.engine.metrics(), b"text/plain; version=0.0.4; charset=utf-8")
        elif path == b"/version":
            self.reply(b"200 OK", b'{"version":"%s"}' % self.engine.version.encode())
        else:
            self.reply(b"404 Not Found", b'{"detail":"Not Found"}')

    def reply(self, status: bytes, body: bytes, content_type: bytes = _JSON) -> None:
        kind = b"content-type: %s\r\n" % content_type if content_type else b""
        close = b"" if self.keep_alive else b"connection: close\r\n"
        self.transport.write(b"HTTP/1.1 %s\r\n%scontent-length: %d\r\n%s\r\n%s" % (status, kind, len(body), close,
                                                                                   body))
        self.done()

    def done(self) -> None:
        if not self.keep_alive:
            self.transport.close()


async def serve(engine: Engine, host: str, port: int, ready: asyncio.Event | None = None,
                reuse_port: bool = False) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(engine), host, port, backlog=4096,
                                      reuse_port=reuse_port or None)
    if ready is not None:
        ready.set()
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="tiny", help="the served model's name (tiny)")
    parser.add_argument("--max-model-len", type=int, default=32768, help="what /v1/models says (32768)")
    parser.add_argument("--token-delay", type=float, default=0.02, help="seconds between a stream's tokens (0.02)")
    parser.add_argument("--processes", type=int, default=1, help="processes serving the port (1)")
    args = parser.parse_args(argv)
    import os

    import uvloop

    shared = args.processes > 1
    for _ in range(args.processes - 1):
        if os.fork() == 0:  # a child: serves until killed with the group (the harness stops the whole group)
            break
    engine = Engine(args.model, args.max_model_len, args.token_delay)
    uvloop.run(serve(engine, args.host, args.port, reuse_port=shared))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
