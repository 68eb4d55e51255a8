#!/usr/bin/env bash
# Debian's chromium and chromium-driver, for the live page's browser tests (Selenium drives them
# through the named driver: nothing downloads a browser or a driver). Does nothing when both are
# installed; without apt-get it says what to install (those tests are then skipped).
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: no apt-get here: install chromium and its chromedriver for the browser tests" >&2
    exit 0
fi
sudo=()
if [[ "$(id -u)" != 0 ]]; then sudo=(sudo); fi
echo "setup: installing chromium and chromium-driver with apt-get (about 20 s)"
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq chromium chromium-driver >/dev/null
