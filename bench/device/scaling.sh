#!/usr/bin/env bash
# How --workers N scales on a machine with cores to spare (the device: 16 cores, no network): chats/s and relayed
# tokens/s at 1, 2, 4 and 8 workers in front of the fast fake engine, the admission authority serving and apart
# (--authority), each process's CPU per request it served, and the Amdahl bound (python -m bench run scaling;
# docs/overhead.md). Under 8 minutes: seven gateways of about 30 s each.
#
#     bash bench/device/prepare.sh                # once, where the package index is reachable: .cache/device/
#     bash bench/device/scaling.sh                # on the device, from the repository's root, .cache/device carried
#
# Cores: the gateway's N processes on the first N of 0-7, the fake engine's 4 processes on 8-11, wrk (4 threads)
# and the stream clients (4 processes) on 12-15. Results go to $OUT/scaling/ (or bench/results/scaling/).
# WORKERS, SECONDS_A_LOAD, STREAMS, CONNECTIONS and the *_CPUS variables override the defaults (a rehearsal on a small
# machine: WORKERS=1,2 SECONDS_A_LOAD=2 GATEWAY_CPUS=1 ENGINE_CPUS=0 CLIENT_CPUS=0 ENGINE_PROCESSES=1 CLIENTS=1).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
DEV=$PWD/.cache/device
VENV=${SCALING_VENV:-/tmp/vllm-guard-venv}
[ -d "$DEV/wheels" ] || { echo "scaling: $DEV/wheels is missing: run bench/device/prepare.sh and carry .cache/device" >&2; exit 2; }

# A virtual environment of the carried wheels that also sees the interpreter's own packages (a .pth file): the
# servers the harness starts run sys.executable, so they find both without PYTHONPATH.
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --without-pip "$VENV"
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$DEV"/wheels/*.whl
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/zz-image-packages.pth"
fi
export PATH="$DEV/bin:$PATH" PYTHONUNBUFFERED=1
said=$(wrk -v 2>&1 || true)  # wrk -v prints its version and exits 1
case "$said" in wrk*) ;; *) echo "scaling: wrk does not run here: $said" >&2; ldd "$DEV/bin/wrk.bin" >&2; exit 3 ;; esac
"$VENV/bin/python" -c 'import gateway.cli, bench.cli; bench.cli.parser()'
echo "scaling: $(nproc) cores, $("$VENV/bin/python" -V), load $(cut -d' ' -f1-3 /proc/loadavg)"

RESULTS=${OUT:-$PWD/bench/results}
timeout "${LIMIT_S:-440}" "$VENV/bin/python" -m bench run scaling \
    --workers-list "${WORKERS:-1,2,4,8}" --seconds "${SECONDS_A_LOAD:-10}" --repeat 1 \
    --gateway-cpus "${GATEWAY_CPUS:-0-7}" --engine-cpus "${ENGINE_CPUS:-8-11}" --client-cpus "${CLIENT_CPUS:-12-15}" \
    --engine-processes "${ENGINE_PROCESSES:-4}" --client-threads "${CLIENT_THREADS:-4}" \
    --connections "${CONNECTIONS:-256}" --stream-clients "${CLIENTS:-4}" --stream-load "${STREAMS:-1024x100@0.01}" \
    --out "$RESULTS"
