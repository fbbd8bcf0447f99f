#!/usr/bin/env bash
# The project's test command: set-up, then the whole pytest suite (end-to-end tests against a real
# vLLM included), ruff and mypy. Every step runs even when an earlier one fails, so one run shows
# everything that is wrong; the exit status is non-zero when any step failed.
#
#   scripts/test.sh                      everything
#   scripts/test.sh -m 'not e2e' -x      extra arguments go to pytest (and skip the workers matrix)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

"$ROOT/scripts/setup.sh" || { echo "test: setup failed" >&2; exit 1; }
# Prometheus and promtool for the deployment checks (Debian's package); where they cannot be installed,
# those tests say so and skip.
"$ROOT/scripts/install-prometheus.sh" || echo "test: Prometheus could not be installed; its checks will skip" >&2
# redis-server for the tenant limits shared by replicas (Debian's package); where it cannot be installed,
# those tests say so and skip.
"$ROOT/scripts/install-redis.sh" || echo "test: redis-server could not be installed; the Redis tests will skip" >&2
# Chromium for the live page's browser test (Debian's package); where it cannot be installed, that test skips.
"$ROOT/scripts/install-chromium.sh" || echo "test: Chromium could not be installed; the browser test will skip" >&2

PY="$ROOT/.venv/bin/python"
failed=()

# Records a pytest run's exit status: $1 names the run, $2 is the status. Exit code 5 means pytest collected
# nothing: a suite that tests nothing is broken, not green.
record() {
    case "$2" in
        0) ;;
        5) echo "test: $1 collected no tests (exit 5); treating that as a failure" >&2; failed+=("$1(no tests)") ;;
        *) failed+=("$1(exit $2)") ;;
    esac
}

echo "test: pytest $*"
"$PY" -m pytest "$@"
record pytest $?

# The workers matrix: the suites that cross the admission authority's channel (admission, tenants, the hostile
# clients and upstreams, stream usage, the access log) once more with every gateway split into the authority and
# a worker process (testing/gateway_thread.py). Only on a whole run: extra arguments choose a part of the suite.
WORKERS_SUITES=(
    tests/integration/hostile
    tests/integration/test_admission_flood.py
    tests/integration/test_fair_queueing.py
    tests/integration/test_tenants.py
    tests/integration/test_stream_usage.py
    tests/integration/test_access_log.py
)
if [ "$#" -eq 0 ]; then
    echo "test: pytest with VLLM_GUARD_TEST_WORKERS=2 ${WORKERS_SUITES[*]}"
    VLLM_GUARD_TEST_WORKERS=2 "$PY" -m pytest -q "${WORKERS_SUITES[@]}"
    record pytest-workers $?
    # The runs above used the admission compiled by mypyc where setup built it for these sources; the pure
    # modules run wherever none matches (an edited checkout, no C compiler): their own tests once more on them.
    echo "test: pytest -p testing.pure tests/unit/admission tests/unit/workers (the pure Python admission)"
    "$PY" -m pytest -q -p testing.pure tests/unit/admission tests/unit/workers
    record pytest-pure $?
fi

echo "test: ruff check"
"$ROOT/.venv/bin/ruff" check . || failed+=("ruff")

echo "test: mypy (strict, per pyproject.toml)"
"$ROOT/.venv/bin/mypy" || failed+=("mypy")

if [ "${#failed[@]}" -gt 0 ]; then
    echo "test: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "test: all passed (pytest, ruff, mypy)"
