#!/usr/bin/env bash
# Installs redis-server (Debian's `redis-server` package) for the tests of tenant limits shared through Redis
# (tests/integration/test_tenants.py). Idempotent: does nothing when redis-server is already on PATH.
# The package's service is never started here: the tests run their own redis-server on 127.0.0.1.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    echo "redis-server already installed: $(redis-server --version | head -n1)"
    exit 0
fi

"$(dirname "${BASH_SOURCE[0]}")/apt-install-quiet.sh" redis-server
redis-server --version | head -n1
