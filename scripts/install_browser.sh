#!/usr/bin/env bash
# Install Debian's chromium for the dump page's browser test. Safe to run again:
# does nothing when chromium is already there, and never fails the caller when it
# cannot install (no root, no apt, no registry): the browser test then skips.
set -u
BROWSER=/usr/bin/chromium
if [ -x "$BROWSER" ]; then
    echo "install_browser: $BROWSER already present"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: no apt-get here; install chromium yourself to run the browser test"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install_browser: not root and no passwordless sudo; cannot install chromium"
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
if $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null; then
    echo "install_browser: installed $($BROWSER --version 2>/dev/null || echo chromium)"
else
    echo "install_browser: apt-get could not install chromium; the browser test will skip"
fi
exit 0
