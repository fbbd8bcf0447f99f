"""Starting the targets a benchmark measures: engines (the fast fake engine, the vLLM simulator, a real vLLM CPU
build with flags) and proxies in front of one (the gateway of this tree or of a commit, vllm-router, a
round-robin forwarder). Each function returns a ``bench.harness.target.Target`` not yet started:
``Context.start`` starts and waits for it, and stops it at the end."""
