"""``--workers N``: the admission authority's side (``authority``) and a worker's (``assembly``, ``remote``), and
what crosses the channel between them (``channel``, ``codec``, ``messages``).

A worker runs the same request path as one process, with stand-ins for what must be one for the whole gateway:
its admission, tenants, engines' progress and access log ask or tell the authority (``gateway.guard.seams``
declares what each must offer).
"""

__all__ = [
    "assembly",  # build_worker_parts: a worker's parts
    "authority",  # Authority: the admission authority's side of the channel
    "liveness",  # whether the authority is heard from
    "messages",  # what crosses the channel
    "metrics_merge",  # the workers' metric families, merged
    "remote",  # AuthorityClient and the stand-ins
]
