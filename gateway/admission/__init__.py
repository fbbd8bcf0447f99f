"""KV-aware admission: admit, queue or shed each request against the engine's KV budget."""

from gateway.admission.controller import Admission
from gateway.admission.reservation import Reservation

__all__ = ["Admission", "Reservation"]
