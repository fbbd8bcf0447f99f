"""A channel transport for the workers' unit tests: it keeps what is written and reads it back as messages."""

from __future__ import annotations

import struct
from typing import Any

import orjson

from gateway.workers.messages import Message, decode, encode


def frames(*messages: Message) -> bytes:
    """``messages`` as a peer writes them on the channel."""
    return b"".join(struct.pack(">I", len(b := orjson.dumps(encode(m), option=orjson.OPT_NON_STR_KEYS))) + b
                    for m in messages)


class Counts:
    """The authority's record of its workers' metrics, not kept (``metrics_merge.WorkerCounts``)."""

    def seen(self, worker: object, families: Any) -> None:
        pass

    def lost(self, worker: object) -> None:
        pass


class Transport:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def get_write_buffer_size(self) -> int:
        return 0

    def close(self) -> None:
        pass

    def sent(self) -> list[Message]:
        """The messages written since the last call, in order."""
        out, at = [], 0
        while at < len(self.data):
            (length,) = struct.unpack_from(">I", self.data, at)
            out.append(decode(orjson.loads(bytes(self.data[at + 4 : at + 4 + length]))))
            at += 4 + length
        self.data.clear()
        return out
