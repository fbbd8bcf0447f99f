"""vllm-guard's benchmarks: one harness, one entry point.

    python -m bench list                               the benchmarks and what each measures
    python -m bench run overhead --repeat 3            one benchmark, its targets in turns
    python -m bench run relay --baseline-commit HEAD~3 adds the gateway at that commit as target 'baseline'
    python -m bench report                             docs/benchmarks.md from the latest results

Layers, each importing only those before it (tests/bench/test_layers.py checks it): ``servers`` (the fake engine,
the simulator, a round-robin forwarder: programs of their own, importing nothing of the harness), ``harness``
(processes, CPU accounting, runs in turns, results), ``targets`` (starting engines and proxies), ``workloads``
(the traffic and its clients), ``benchmarks`` (one module each), then ``registry``, ``report`` and ``cli``.
"""
