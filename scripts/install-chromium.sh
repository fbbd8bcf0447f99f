#!/usr/bin/env bash
# Installs Chromium (Debian's `chromium` package) for the live page's browser test, tests/integration/test_ui_browser.py,
# which drives it headless. Idempotent: does nothing when a chromium binary is already on PATH.
set -euo pipefail

for bin in chromium chromium-browser; do
    if command -v "$bin" >/dev/null 2>&1; then
        echo "chromium already installed: $("$bin" --version 2>/dev/null | head -n1)"
        exit 0
    fi
done

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-chromium: no apt-get here; install Chromium by other means" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# A font the page's text renders with in screenshots; the package pulls in no desktop.
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null

chromium --version 2>/dev/null | head -n1
