"""Both sides of each of the request path's seams (``gateway.guard.seams``), held to it by the type checker: one
process's parts and a worker's stand-ins. Nothing here runs: a stand-in or a part that drifts from its seam (a
method renamed, a signature changed) fails ``mypy`` here, whether or not an assembly passes it through the seam yet.
"""

from __future__ import annotations

from gateway.admission.controller import Admission
from gateway.admission.reservation import Reservation
from gateway.engine.progress import ProgressDetector
from gateway.guard.seams import AccessLogging, Admitting, Granted, Held, Progress, TenantLimits
from gateway.observe.access_log import AccessLog
from gateway.tenants.service import Grant, Tenants
from gateway.workers.access_log import ForwardedAccessLog
from gateway.workers.remote import RemoteAdmission, RemoteGrant, RemoteReservation, RemoteTenants


def one_process(
    admission: Admission, reservation: Reservation, tenants: Tenants, grant: Grant, progress: ProgressDetector,
    access_log: AccessLog,
) -> tuple[Admitting, Held, TenantLimits, Granted, Progress, AccessLogging]:
    return admission, reservation, tenants, grant, progress, access_log


def worker(
    admission: RemoteAdmission, reservation: RemoteReservation, tenants: RemoteTenants, grant: RemoteGrant,
    progress: ProgressDetector, access_log: ForwardedAccessLog,
) -> tuple[Admitting, Held, TenantLimits, Granted, Progress, AccessLogging]:
    return admission, reservation, tenants, grant, progress, access_log
