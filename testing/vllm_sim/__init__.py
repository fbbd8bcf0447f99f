"""A vLLM 0.32 (V1) simulator without a model: its OpenAI API, error texts, metrics and KV-block behaviour.

The server and app are in app.py (the Responses API and pooling routes in routes.py, what their handlers share in
handling.py), the engine in engine.py (blocks in blocks.py, metrics in metrics.py), prompt rendering and counting
in text.py, data parallelism in dp.py, request and response shapes in wire.py, the configuration and sequences in
types.py. What tests and benchmarks use is named here.
"""

from .app import (
    DataParallelSimulator,
    Fault,
    SimConfig,
    SimServer,
    Simulator,
    create_sim_app,
    lognormal_lengths,
    run_sim_server,
)

__all__ = ["DataParallelSimulator", "Fault", "SimConfig", "SimServer", "Simulator", "create_sim_app",
           "lognormal_lengths", "run_sim_server"]
