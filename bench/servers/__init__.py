"""Programs the benchmarks start as servers of their own (``python -m bench.servers.<name>``): the fast fake engine,
the vLLM simulator, a round-robin forwarder, vLLM's CPU build bound to a core. They import nothing of the harness."""
