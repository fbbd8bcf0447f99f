"""KV-aware admission: admit, queue or shed each request against the engine's KV budget."""

from gateway import native

native.activate(__path__)  # the modules compiled by mypyc, where a build matches these sources (native.py)

from gateway.admission.controller import Admission  # noqa: E402
from gateway.admission.reservation import Reservation  # noqa: E402

__all__ = ["Admission", "Reservation"]
