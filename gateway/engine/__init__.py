"""One vLLM engine as the gateway knows it: its HTTP client, its served models, the live view of its metrics, whether
it makes progress and whether it says it is healthy (``engine.Engine`` holds them together).

The modules the layers above use are its public names; the rest (the connection pool, the wire format, the
queue-cap reading's details) are the package's own.
"""

__all__ = [
    "client",  # Upstream: the one HTTP client per engine, its streams and errors
    "engine",  # Engine: what the gateway knows of one engine
    "health",  # EngineHealth: the engine's own /health
    "live",  # EngineView, EngineSnapshot: the scraped /metrics
    "models",  # ServedModels: the engine's model listing
    "progress",  # ProgressDetector: hung or not while work runs
    "queue_cap",  # QueueCap: vLLM's own queue cap
    "sse",  # reading event streams
    "usage",  # what the client asked of usage, the engine's fingerprint
    "vllm_api",  # vLLM's HTTP surfaces, each read in one place
]
