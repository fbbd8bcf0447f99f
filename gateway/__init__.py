"""vllm-guard: an OpenAI-compatible guarding proxy in front of vLLM."""

__version__ = "0.1.0"
