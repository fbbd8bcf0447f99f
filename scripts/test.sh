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

echo "test: pytest $*"
"$PY" -m pytest "$@"
rc=$?
case "$rc" in
    0) ;;
    # Exit code 5 means pytest collected nothing: a suite that tests nothing is broken, not green.
    5) echo "test: pytest collected no tests (exit 5); treating that as a failure" >&2; failed+=("pytest(no tests)") ;;
    *) failed+=("pytest(exit $rc)") ;;
esac

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
    rc=$?
    case "$rc" in
        0) ;;
        5) echo "test: the workers matrix collected no tests (exit 5); treating that as a failure" >&2
           failed+=("pytest-workers(no tests)") ;;
        *) failed+=("pytest-workers(exit $rc)") ;;
    esac
fi

if [ "$#" -eq 0 ]; then
    # The suite above ran the compiled admission where setup built it; the pure modules run wherever none matches.
    echo "test: pytest -p testing.pure tests/unit/admission tests/unit/workers (the pure Python admission)"
    "$PY" -m pytest -q -p testing.pure tests/unit/admission tests/unit/workers
    rc=$?
    case "$rc" in
        0) ;;
        5) echo "test: the pure admission run collected no tests (exit 5); treating that as a failure" >&2
           failed+=("pytest-pure(no tests)") ;;
        *) failed+=("pytest-pure(exit $rc)") ;;
    esac
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
