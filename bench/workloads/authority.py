"""The admission authority's own work for a worker's request, in-process: no sockets, no other process.

    python -m bench.workloads.authority [--requests 20000] [--batch 1 16]     # prints one JSON object

Run by ``python -m bench run authority`` with the gateway of this tree or of a commit first on the path. The
authority's side of one worker's channel (``WorkerLink``) on a real ``Admission`` (a KV budget no short chat fills,
no engine to scrape) and the tenants of a gateway without a keys file (each request charged to the default tenant
and settled, as a worker's ``Charge`` asks) is handed each request's frames as a worker writes them: its
``Admit``, then its ``End`` with its release folded in (what a short chat sends; to a gateway from before the
fold, a ``Release`` and an ``End``), ``--batch`` requests' frames in one read (a busy worker's reads carry
several); the frames are encoded before the clock starts, and what the authority writes back is counted, not
decoded. The process's CPU time per request, over ``--requests``: ``authority_b<B>`` for each batch size, and
``alone``, the same admission entered and left directly (``async with`` the reservation, as one process does), whose
difference is the channel's and the authority's own bookkeeping. Each figure includes the loop's turns between the
reads (two after each read, as a reply's write waits for one): ``turns`` is their cost alone.
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

WARM_UP = 2000  # requests before the clock starts: the allocator's and the admission's first growth
TURNS = 2  # loop turns after each read: the authority's replies go out on the next turn (``Channel.send``)


class Sink:
    """The channel's transport: what the authority writes is counted, not kept."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        pass


def _frames(messages: list[Any]) -> bytes:
    from gateway.workers.messages import encode

    out = []
    for m in messages:
        body = orjson.dumps(encode(m), option=orjson.OPT_NON_STR_KEYS)
        out.append(struct.pack(">I", len(body)) + body)
    return b"".join(out)


def _admission() -> Any:
    return _parts().admission


def _parts() -> Any:
    """What the authority is handed in a gateway without a keys file: a real ``Admission`` and the tenants (every
    request the default tenant's, charged and settled as the gateway does)."""
    from gateway.admission.controller import Admission
    from gateway.config import Settings
    from gateway.metrics import Metrics
    from gateway.tenants.service import Tenants

    settings = Settings.model_validate({"kv_blocks": 10_000_000, "block_size": 16})
    metrics = Metrics()
    return SimpleNamespace(admission=Admission(settings, None, metrics), tenants=Tenants(settings, metrics),
                           every_engine=lambda: [], access_log=SimpleNamespace(write_lines=lambda lines: None))


async def _turns() -> None:
    for _ in range(TURNS):
        await asyncio.sleep(0)


async def authority(requests: int, batch: int, prompt_tokens: int) -> float:
    """CPU us per request the authority spends on a worker's short chat (its frames ``batch`` to a read)."""
    from gateway.workers.authority import Authority, WorkerLink
    from gateway.workers.messages import Admit, Booking, Charge, End, Release

    parts = _parts()
    admission = parts.admission
    link = WorkerLink(parts, Authority(parts, Path("/nonexistent")))  # type: ignore[arg-type]
    link.channel.connection_made(Sink())  # type: ignore[arg-type]

    def ends(key: int) -> list[Any]:
        """What the target's worker sends as a short chat ends: its release folded into its end where the target's
        ``End`` carries one (one frame), else a ``Release`` and an ``End``. Sixteen tokens at once are no first-token
        sample: where the target's release has room for its time, there is none."""
        fields = End.__dataclass_fields__
        if "released" in fields:
            return [End(key, 0.0, (True, 16, None) if "float" in str(fields["released"].type) else (True, 16))]
        return [Release(key, True, 16), End(key, 0.0)]

    def reads(first: int, count: int) -> list[tuple[bytes, bytes]]:
        out = []
        for start in range(first, first + count, batch):
            keys = range(start, min(start + batch, first + count))
            admits = [Admit(k, Booking(f"r{k}", prompt_tokens, 16, 1, 0, "default", 1.0, None, (), "m/chat", None,
                                       None, 0), Charge("default", prompt_tokens, 16)) for k in keys]
            out.append((_frames(admits), _frames([m for k in keys for m in ends(k)])))
        return out

    async def serve(frames: list[tuple[bytes, bytes]]) -> None:
        for admits, ends in frames:
            link.channel.data_received(admits)
            await _turns()
            link.channel.data_received(ends)
            await _turns()

    await serve(reads(1, WARM_UP))
    timed = reads(WARM_UP + 1, requests)
    start = time.process_time()
    await serve(timed)
    spent = time.process_time() - start
    if admission.in_flight or admission.queued or link.requests:
        raise RuntimeError(f"the authority still holds {len(link.requests)} requests ({admission.in_flight} admitted)")
    return spent / requests * 1e6


async def alone(requests: int, prompt_tokens: int) -> float:
    """CPU us per request of the same admission entered and left directly."""
    admission = _admission()

    async def serve(first: int, count: int) -> None:
        for k in range(first, first + count):
            r = admission.reservation(prompt_tokens=prompt_tokens, max_tokens=16, n=1, priority=0, request_id=f"r{k}")
            async with r:
                r.observe_output_tokens(16)

    await serve(1, WARM_UP)
    start = time.process_time()
    await serve(WARM_UP + 1, requests)
    return (time.process_time() - start) / requests * 1e6


async def turns(requests: int, batch: int) -> float:
    """CPU us per request of the loop's turns ``authority`` makes, with nothing to do."""
    start = time.process_time()
    for _ in range(0, requests, batch):
        await _turns()
        await _turns()
    return (time.process_time() - start) / requests * 1e6


def measure(requests: int, batches: list[int], prompt_tokens: int) -> dict[str, float]:
    async def main() -> dict[str, float]:
        out = {"alone": await alone(requests, prompt_tokens)}
        for b in batches:
            out[f"authority_b{b}"] = await authority(requests, b, prompt_tokens)
            out[f"turns_b{b}"] = await turns(requests, b)
        return out

    try:
        import uvloop  # the gateway's loop

        return uvloop.run(main())
    except ImportError:
        return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, default=30)
    args = parser.parse_args(argv)
    sys.stdout.write(orjson.dumps(measure(args.requests, args.batch, args.prompt_tokens)).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
