#!/usr/bin/env bash
# Installs Prometheus and promtool (Debian's `prometheus` package) for the deployment checks in
# tests/deploy/. Idempotent: does nothing when both binaries are already on PATH.
# The package's service is never started here: the tests run their own Prometheus on 127.0.0.1.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    echo "prometheus already installed: $(promtool --version 2>&1 | head -n1)"
    exit 0
fi

"$(dirname "${BASH_SOURCE[0]}")/apt-install-quiet.sh" prometheus
promtool --version 2>&1 | head -n1
