#!/usr/bin/env bash
# Installs Debian packages without starting their services: the tests run their own daemons on 127.0.0.1.
# Used by install-prometheus.sh and install-redis.sh.
#
#   scripts/apt-install-quiet.sh PACKAGE [PACKAGE ...]
set -euo pipefail

if ! command -v apt-get >/dev/null 2>&1; then
    echo "apt-install-quiet: no apt-get here; install $* by other means" >&2
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
$SUDO apt-get install -y -qq --no-install-recommends "$@" >/dev/null
