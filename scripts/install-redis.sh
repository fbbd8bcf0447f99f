#!/usr/bin/env bash
# Installs redis-server (Debian's `redis-server` package) for the tests of tenant limits shared through Redis
# (tests/integration/test_tenants.py). Idempotent: does nothing when redis-server is already on PATH.
# The package's service is never started here: the tests run their own redis-server on 127.0.0.1.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    echo "redis-server already installed: $(redis-server --version | head -n1)"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-redis: no apt-get here; install redis-server by other means" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

# policy-rc.d exit 101 stops the package's post-install step from starting a system-wide daemon.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod 755 "$policy"
    created_policy=1
fi
cleanup() {
    if [ "$created_policy" -eq 1 ]; then
        $SUDO rm -f "$policy"
    fi
}
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null

redis-server --version | head -n1
