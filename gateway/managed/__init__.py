"""Running and supervising the managed vLLM engine: its process, its log, its lifecycle and its restarts."""
