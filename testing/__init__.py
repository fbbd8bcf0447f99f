"""What the tests and the benchmarks both use: stand-ins for vLLM and the servers they start.

- ``vllm_sim``: a vLLM simulator (its API, metrics and KV blocks, without a model), served in a thread or on a loop.
- ``servers``: a real vLLM (the CPU build on a tiny local model) and the gateway, each a subprocess.
- ``gateway_thread``: the real gateway app on a real socket, uvicorn in a thread (``run_gateway``).
- ``fake_vllm``: a stand-in for vLLM's API server process (its log lines, failures and flags), for managed mode.
- ``bad_upstream``, ``rogue_engine``: misbehaving engines on loopback (scripted bytes; garbage, resets, hangs).
- ``hostile_checks``: hostile clients' requests and the checks on what the gateway answers them.
- ``otlp_receiver``: an OTLP/HTTP receiver that decodes the spans it is sent.
- ``payloads``: deterministic prompts of known size.

It may import ``gateway``; ``gateway`` never imports it, and it imports nothing from ``tests`` or ``bench``.
"""
