"""The HTTP layer: the only one that knows the web framework. It reads requests, authenticates them, hands the
guarded ones to the request path (``gateway.guard``) and writes its answers and errors; it assembles the gateway's
parts at start-up and, with ``--workers``, runs the worker processes.
"""

__all__ = [
    "app",  # the application: its routes and its lifetime
    "serving",  # the server on the gateway's port
    "workers",  # --workers: the worker processes
]
