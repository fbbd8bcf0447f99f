"""Running and supervising the managed vLLM engine: its process, its log, its lifecycle and its restarts."""

__all__ = [
    "lifecycle",  # EngineLifecycle: the states an engine goes through
    "logfacts",  # what the engine's log says of its death
    "rolling",  # RollingRestarts: restarts asked for or scheduled, one engine at a time
    "supervisor",  # Supervisor: one managed engine (loaded only in managed mode: GPU and process tooling)
    "tasks",  # OwnedTasks: background tasks owned and awaited
]
