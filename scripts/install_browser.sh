#!/usr/bin/env bash
# Install Debian's chromium (the dump page's browser test) and graphviz (SVG renders of
# small graphs). Safe to run again: installs only what is missing, and never fails the
# caller when it cannot install (no root, no apt, no registry): those tests then skip.
set -u
PKGS=()
[ -x /usr/bin/chromium ] || PKGS+=(chromium fonts-dejavu-core)
command -v dot >/dev/null 2>&1 || PKGS+=(graphviz)
if [ ${#PKGS[@]} -eq 0 ]; then
    echo "install_browser: chromium and graphviz already present"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: no apt-get here; install ${PKGS[*]} yourself to run the browser tests"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install_browser: not root and no passwordless sudo; cannot install ${PKGS[*]}"
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
if $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${PKGS[@]}" >/dev/null; then
    echo "install_browser: installed ${PKGS[*]}"
else
    echo "install_browser: apt-get could not install ${PKGS[*]}; the tests that need them will skip"
fi
exit 0
