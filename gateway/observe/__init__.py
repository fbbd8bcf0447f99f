"""What the gateway tells of itself besides its answers: the access log, traces, the live page's history, the event
loop's lag, the host's CPU pressure and the process's logging."""

__all__ = [
    "access_log",  # AccessLog: one line per guarded request
    "cpu_pressure",  # the host's CPU pressure (PSI)
    "history",  # Sampler, History: the live page's samples
    "loop_lag",  # LoopLag: the event loop's lag
    "process_logging",  # the process's logging set-up
    "trace_export",  # start_tracing: the no-op Tracing, or OpenTelemetry's with an endpoint
    "tracing",  # Tracing, RequestTrace: requests' spans (OpenTelemetry in ``otel``, loaded only when on)
]
