#!/usr/bin/env bash
# Gathers, on a machine with the package index, what bench/device/scaling.sh needs on a machine without a network:
# the Python wheels its image lacks (CPython 3.12, manylinux x86-64; the versions of this checkout's .venv) and wrk
# with its LuaJIT library, all under .cache/device/ (ignored by git; carried to the device as one path).
#
#     bash bench/device/prepare.sh          # then: carry .cache/device, run bench/device/scaling.sh
#
# The image is known to hold (docs/overhead.md says where the list comes from): transformers, tokenizers,
# huggingface-hub, jinja2, aiohttp, httpx, anyio, h11, uvloop, psutil, prometheus-client, pyyaml, protobuf,
# nvidia-ml-py, numpy. What the gateway and the harness import beyond those is in WHEELS.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEV=$ROOT/.cache/device
VENV_PY=${VENV_PY:-$ROOT/.venv/bin/python}
WHEELS=(fastapi starlette uvicorn httptools orjson pydantic pydantic-core pydantic-settings python-dotenv
        annotated-types typing-inspection typing-extensions annotated-doc redis sniffio importlib-metadata
        opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
        opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common googleapis-common-protos
        python-multipart email-validator dnspython openai distro jiter httpx2 httpcore2)
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

mkdir -p "$DEV/wheels" "$DEV/bin"
pins=$("$VENV_PY" - "${WHEELS[@]}" <<'PY'
import importlib.metadata as md, sys
out = []
for name in sys.argv[1:]:
    try:
        out.append(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        out.append(name)  # not in this checkout's environment: the newest
print(" ".join(out))
PY
)
# shellcheck disable=SC2086
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEV/wheels" $pins

# wrk and the LuaJIT library it links (the device's libc and OpenSSL 3 serve the rest), behind a wrapper.
wrk_bin=$(command -v wrk) || { echo "prepare: wrk is not installed here (apt-get install wrk)" >&2; exit 1; }
cp "$wrk_bin" "$DEV/bin/wrk.bin"
mkdir -p "$DEV/bin/lib"
cp -L "$(ldd "$wrk_bin" | awk '/libluajit/ {print $3}')" "$DEV/bin/lib/"
cat > "$DEV/bin/wrk" <<'SH'
#!/bin/sh
here=$(dirname "$0")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/wrk.bin" "$@"
SH
chmod +x "$DEV/bin/wrk"
du -sh "$DEV"
