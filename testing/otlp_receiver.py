"""A real OTLP/HTTP trace receiver for tests: an HTTP server on 127.0.0.1 that decodes each
``ExportTraceServiceRequest`` (protobuf, as the OpenTelemetry SDK's exporter and vLLM's send it) with
``opentelemetry-proto`` and keeps its spans, flattened, for tests to read."""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

# opentelemetry.proto.trace.v1.Span.SpanKind and Status.StatusCode, by number.
KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
STATUS = {0: "unset", 1: "ok", 2: "error"}


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: str
    attributes: dict[str, Any]
    status: str
    status_message: str
    start_ns: int
    end_ns: int
    service: str  # the resource's service.name
    resource: dict[str, Any]


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    if kind is None:
        return None
    return getattr(value, kind)


def decode(payload: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(payload)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: value_of(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(ReceivedSpan(
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                    name=s.name, kind=KINDS.get(s.kind, str(s.kind)),
                    attributes={a.key: value_of(a.value) for a in s.attributes},
                    status=STATUS.get(s.status.code, str(s.status.code)), status_message=s.status.message,
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    service=str(resource.get("service.name", "")), resource=resource,
                ))
    return spans


class OtlpReceiver:
    """What the receiver got: spans in arrival order, and the paths posted to."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.paths: list[str] = []
        self._changed = threading.Condition()
        self.url = ""

    def add(self, path: str, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self.paths.append(path)
            self.spans.extend(spans)
            self._changed.notify_all()

    def wait_for(self, found: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0) -> list[ReceivedSpan]:
        """The spans once ``found`` holds for them (waiting for exports as they arrive); AssertionError after
        ``timeout`` seconds."""
        with self._changed:
            if not self._changed.wait_for(lambda: found(list(self.spans)), timeout):
                raise AssertionError(f"the spans expected did not arrive in {timeout} s; got {self.names()}")
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._changed:
            return [s for s in self.spans if s.trace_id == trace_id]

    def names(self) -> list[str]:
        with self._changed:
            return [s.name for s in self.spans]


def _handler(receiver: OtlpReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            payload = self.rfile.read(int(self.headers.get("content-length", "0")))
            encoding = self.headers.get("content-encoding", "")
            if encoding == "gzip":
                payload = gzip.decompress(payload)
            elif encoding == "deflate":
                payload = zlib.decompress(payload)
            receiver.add(self.path, decode(payload))
            body = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet in test output
            pass

    return Handler


@contextmanager
def run_otlp_receiver() -> Iterator[OtlpReceiver]:
    """A receiver on a free port; ``receiver.url`` is its base URL (post to ``/v1/traces``)."""
    receiver = OtlpReceiver()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(receiver))
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
