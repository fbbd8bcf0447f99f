"""The benchmarks' traffic and the clients that send it, one module per workload: what is sent and what the client
saw of it, without starting servers or comparing targets (bench.harness and bench.targets do that)."""
