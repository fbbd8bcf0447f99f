#!/usr/bin/env bash
# vLLM's CPU build and the gateway each in a cpu cgroup of its own (as two containers are), the load client in the
# root group: what a spinning vLLM leaves the gateway at each ratio of CPU weights (docs/deploy.md, "The gateway's
# CPU"). Needs root and cgroup v1's cpu controller at /sys/fs/cgroup/cpu. Run from the repository root:
#   VLLM_SHARES=1024 bash bench/placement/cgroups.sh 1024:1 4096:1 1024:2 4096:2    # GATEWAY_SHARES:SEED ...
set -euo pipefail
CG=/sys/fs/cgroup/cpu
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-$(ls -d .models/tiny-ctx2048-* | head -1)}
KV_BYTES=${KV_BYTES:-33554432}   # 256 blocks of the tiny model
mkdir -p "$CG/guard-vllm" "$CG/guard-gateway"
echo "${VLLM_SHARES:-1024}" > "$CG/guard-vllm/cpu.shares"
sh -c "echo \$\$ > $CG/guard-vllm/cgroup.procs; exec $PY -m vllm.entrypoints.openai.api_server --model $MODEL \
  --served-model-name tiny --port 18000 --dtype float32 --max-model-len 2048 --kv-cache-memory-bytes $KV_BYTES" \
  > /tmp/cgroups-vllm.log 2>&1 &
vllm=$!
trap 'kill $vllm 2>/dev/null || true' EXIT
for _ in $(seq 150); do curl -sf localhost:18000/health > /dev/null && break; sleep 2; done
words=0
for spec in "$@"; do
  shares=${spec%%:*}; seed=${spec#*:}; words=$((words + 1))
  echo "$shares" > "$CG/guard-gateway/cpu.shares"
  sh -c "echo \$\$ > $CG/guard-gateway/cgroup.procs; exec $PY -m gateway.cli serve \
    --upstream http://127.0.0.1:18000 --port 18080 ${GATEWAY_FLAGS:-}" > /tmp/cgroups-gateway.log 2>&1 &
  gw=$!
  for _ in $(seq 60); do curl -sf localhost:18080/health > /dev/null && break; sleep 1; done
  # The realistic benchmark's own plans, words and client: 32 chat streams/s for 60 s, clients' read timeout 30 s;
  # WORDS differ from run to run so that no run finds another's prompts in vLLM's prefix cache.
  got=$(PYTHONPATH=. $PY - "$seed" http://127.0.0.1:18080 "$words" <<'PY'
import asyncio, dataclasses, json, sys
from bench.targets import engines
from bench.workloads.realistic import figures, plan, prompt
from bench.workloads.realistic_clients import CLIENTS
seed, url, words = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
plans = plan(32.0, 60.0, seed)
texts = [prompt(p, i, seed, words) for i, p in enumerate(plans)]
outcomes = asyncio.run(CLIENTS["aiohttp"](url, plans, texts, engines.eos_id(engines.tiny_model()), 30.0))
got = dataclasses.asdict(figures(outcomes, 5.0))
print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in got.items()}))
PY
)
  read -r run wait _ < "/proc/$gw/schedstat"
  echo "gateway ${shares} : vLLM ${VLLM_SHARES:-1024}, seed $seed: $got; gateway waited ${wait} ns for a core, ran ${run} ns"
  kill "$gw"; wait "$gw" 2>/dev/null || true; sleep 3
done
