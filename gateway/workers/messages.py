"""What crosses between a worker and the admission authority: one dataclass per kind of message, read-only to mypy.

Every request on the channel is named by a **key** the worker makes (a counter of its own, unique on its channel),
never by the client's ``x-request-id``: two requests may carry the same id (a retry that reuses it), and keyed by
it the second would take the first's place and strand its reservation. The client's id crosses only as a label
(``Booking.request_id``: the reservation's id in logs and status).

    worker -> authority                              authority -> worker
    Admit {key, booking, charge}                     Admitted {key, waited_ms, headers, target}
    Withdraw {key}                                   Refused {key, error, headers}
    Progress {tokens, first tokens by key, moves}    State {engines, supervisors, capacity}
    Release {key, completed, generated, first}       MetricsAsk {ask}
    End {key, queue_ms, released}                    Alive {}   (every ``ALIVE_EVERY`` seconds)
    Rejected, Serving, Access {lines}, MetricsReply

A frame is ``[kind, [fields...]]`` (``codec.py``); ``decode`` checks every field of a message against its type
when it arrives, so a handler never sees a malformed one. Measured with ``python -m timeit`` (CPython 3.11, a
busy 2-core host): an admit of a 30-token prompt encodes in 2.7 us and decodes (orjson and every check) in
4.7 us, against 0.7 and 1.1 us as the untyped dict it replaced; a release 0.2 and 0.9 us (0.1 and 0.2). That is
about 6 us more of the authority's loop per request. pydantic (``TypeAdapter.validate_json`` of the same admit as
dataclasses) took 6-8 us to decode alone. Access-log lines cross formatted and redacted, a batch a message: the
authority only writes them (formatting a record there cost its core tens of microseconds a request).

A request's first token is timed where the request was written to its engine, as in one process: the worker
measures from its own write to the token and sends the seconds with the request's first count (``Progress.first``,
or its ``Release`` when that goes first). Timed at the authority instead, from its admission to the progress that
brought the token, the sample would carry the reply's crossing, the worker's turn and the progress's batching (up
to 50 ms, ``remote.PROGRESS_EVERY``), which an engine that answers in 100 ms would be read as doing.

An error refused by the authority (a full queue, a tenant's limit, a deadline) reaches the worker as the same
``GatewayError`` subclass with the same fields, so that the HTTP layer answers it exactly as it would have in one
process. Only the gateway's own error classes are rebuilt; anything else becomes an ``UpstreamUnavailable``
(never a 500 for a refusal that crossed a socket).
"""

from __future__ import annotations

import typing
from array import array
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, dataclass_transform

from gateway import errors
from gateway.admission.destination import Destination
from gateway.admission.ledger import Capacity
from gateway.admission.prefix import PromptPrefix
from gateway.engine.vllm_api import ServedModel
from gateway.errors import GatewayError
from gateway.workers.codec import Decode, Encode, Malformed, decoder, encoder

ALIVE_EVERY = 0.5  # seconds between the authority's heartbeats (``remote.py`` judges their absence)

_T = TypeVar("_T")


@dataclass_transform(frozen_default=True)
def message(cls: type[_T]) -> type[_T]:
    """A dataclass with slots, read-only to mypy (``frozen_default``: assigning a field is a type error, which CI's
    strict mypy refuses) and not frozen at run time: a frozen dataclass sets each field through
    ``object.__setattr__``, and both ends build one for every message that crosses. Built 200,000 times, best of 5
    (CPython 3.11, the 2-core machine): a 13-field ``Booking`` 3.54 us frozen against 0.56 us not; a short chat's
    four messages built at each end cost about 5 us less on each."""
    return dataclass(slots=True)(cls)


# -- what a message carries ---------------------------------------------------------------------------
@message
class ErrorData:
    """A ``GatewayError`` as it crosses: its class's name and its plain attributes (message, code, retry_after)."""

    name: str
    fields: dict[str, Any]


@message
class Booking:
    """What a reservation books (``Admission.reservation``'s arguments)."""

    request_id: str  # the client's id: a label, never the key
    prompt_tokens: int
    max_tokens: int
    n: int
    priority: int
    tenant: str
    weight: float
    prefix: PromptPrefix | None
    avoid: tuple[str, ...]
    family: str
    deadline: float | None
    objective: float | None
    min_output: int


@message
class Charge:
    """A request's charge to its tenant's windows, made with its first admission."""

    tenant: str
    prompt_tokens: int
    output_tokens: int


@message
class EngineState:
    hung: bool
    detail: str | None
    url: str
    refusal: ErrorData | None
    fingerprint_known: bool
    fingerprint: str | None
    models: tuple[ServedModel, ...] | None


@message
class SupervisorState:
    state: str
    retry_after: float
    url: str


# -- worker -> authority ------------------------------------------------------------------------------
@message
class Admit:
    KIND: ClassVar[str] = "admit"
    key: int
    booking: Booking
    charge: Charge | None  # the first admission of a request only (a failover's second is not charged again)


@message
class Withdraw:
    KIND: ClassVar[str] = "withdraw"
    key: int


@message
class Progress:
    KIND: ClassVar[str] = "progress"
    tokens: dict[int, int]  # key -> tokens generated so far
    engines: dict[int, tuple[int, int, int]]  # engine -> (streams opened less closed, chunks, answers) since last
    fingerprints: dict[int, str | None]  # engine -> its system_fingerprint, learned here
    # key -> seconds from the worker's write of the request to its engine to its first token (see above)
    first: dict[int, float]


@message
class Release:
    KIND: ClassVar[str] = "release"
    key: int
    completed: bool
    generated: int
    first: float | None = None  # the first token's time, where no ``Progress`` told it before (see above)


@message
class End:
    """The request is over. ``released``: its last ``Release`` folded in, (completed, generated, first), where the
    worker still held it when the request ended (a short chat's release and end leave in one write: one frame, not two);
    None where it was sent on its own (a stream whose client was still reading, a failover's first attempt)."""

    KIND: ClassVar[str] = "end"
    key: int
    queue_ms: float
    released: tuple[bool, int, float | None] | None = None


@message
class Rejected:
    KIND: ClassVar[str] = "rejected"
    tenant: str
    reason: str


@message
class Serving:
    KIND: ClassVar[str] = "serving"


@message
class Access:
    """Access-log lines the worker formatted and redacted, each ending in a newline, for the authority to write."""

    KIND: ClassVar[str] = "access"
    lines: str


@message
class MetricsReply:
    KIND: ClassVar[str] = "metrics_reply"
    ask: int
    families: tuple[Any, ...]  # ``metrics_merge.families_of``, read there


# -- authority -> worker ------------------------------------------------------------------------------
@message
class Admitted:
    KIND: ClassVar[str] = "admitted"
    key: int
    waited_ms: float
    headers: dict[str, str]
    target: Destination | None


@message
class Refused:
    KIND: ClassVar[str] = "refused"
    key: int
    error: ErrorData | None  # None: the authority failed (a bug of ours): 503, retry
    headers: dict[str, str]


@message
class State:
    """What the request path reads of the engines, as the authority sees them (``mirror.py``)."""

    KIND: ClassVar[str] = "state"
    engines: tuple[EngineState, ...]
    supervisors: tuple[SupervisorState, ...]
    capacity: Capacity | None
    sharing: bool


@message
class MetricsAsk:
    KIND: ClassVar[str] = "metrics"
    ask: int


@message
class Alive:
    """The authority's heartbeat: a worker that hears nothing for a while refuses what would wait on it."""

    KIND: ClassVar[str] = "alive"


Message = (
    Admit | Withdraw | Progress | Release | End | Rejected | Serving | Access | MetricsReply
    | Admitted | Refused | State | MetricsAsk | Alive
)


# -- frames -------------------------------------------------------------------------------------------
def _codecs() -> dict[str, tuple[type, Encode, Decode]]:
    kinds: dict[str, tuple[type, Encode, Decode]] = {}
    for cls in typing.get_args(Message):
        out = encoder(cls)
        assert out is not None
        kinds[cls.KIND] = (cls, out, decoder(cls))
    return kinds


_KINDS = _codecs()
# Kinds nothing waits on and nothing is counted by (a log line, a rejection's tally, a metrics reply whose asker
# has a timeout): one that arrives malformed is dropped; any other ends the channel (``channel.py``).
_DROPPABLE = (Access, Rejected, MetricsReply)
_ENCODE: dict[type, tuple[str, Encode]] = {cls: (kind, out) for kind, (cls, out, _) in _KINDS.items()}


def encode(message: Message) -> list[Any]:
    """The frame orjson writes for ``message``."""
    kind, out = _ENCODE[type(message)]
    return [kind, out(message)]


def decode(frame: Any) -> Message:
    """The message in what ``orjson.loads`` gave, every field checked; ``Malformed`` otherwise."""
    if type(frame) is not list or len(frame) != 2:
        raise Malformed("a frame is [kind, fields]")
    known = _KINDS.get(frame[0]) if type(frame[0]) is str else None
    if known is None:
        raise Malformed(f"no message of kind {str(frame[0])[:40]!r}")
    try:
        message: Message = known[2](frame[1])
    except Malformed as exc:
        exc.droppable = known[0] in _DROPPABLE
        raise
    return message


# -- errors and prompts -------------------------------------------------------------------------------
_CLASSES: dict[str, type[GatewayError]] = {
    name: cls for name, cls in vars(errors).items()
    if isinstance(cls, type) and issubclass(cls, GatewayError)
}
_PLAIN = (str, int, float, bool, type(None))


def error_data(exc: GatewayError) -> ErrorData:
    """The error's class and every plain attribute it carries (message, code, param, retry_after, ...)."""
    return ErrorData(type(exc).__name__, {k: v for k, v in vars(exc).items() if isinstance(v, _PLAIN)})


def error_of(data: ErrorData) -> GatewayError:
    cls = _CLASSES.get(data.name)
    fields = {k: v for k, v in data.fields.items() if isinstance(v, _PLAIN)}
    message = str(fields.get("message", "The gateway's admission failed."))
    if cls is None:
        return errors.UpstreamUnavailable(message, retry_after=1)
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.message, exc.param, exc.retry_after, exc.close_connection = message, None, None, False
    for key, value in fields.items():
        setattr(exc, key, value)
    return exc


def crossing_prefix(prefix: PromptPrefix | None) -> PromptPrefix | None:
    """The prompt's ids as 64-bit integers (what JSON carries exactly, and vLLM's ids fit in); none for ids no
    engine accepts (its blocks are never shared: ``block_keys``)."""
    if prefix is None:
        return None
    try:
        ids = prefix.ids if isinstance(prefix.ids, array) else array("q", prefix.ids)
    except (TypeError, OverflowError):
        return None
    return PromptPrefix(ids, prefix.salt)
