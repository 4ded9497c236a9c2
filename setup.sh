#!/usr/bin/env bash
# Set up the kit in ./.venv (idempotent): Python >= 3.11, pinned dependencies, the kit editable.
# VENV=path overrides the location. On a GPU machine, keep its CUDA torch: KIT_KEEP_TORCH=1.
#   ./setup.sh           the kit and its pinned Python dependencies
#   ./setup.sh --test    also what the test suite needs from the system: an sshd binary (the
#                        launcher's ssh tests start their own sshd on loopback), via apt-get as root
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "--test" ]; then
    if ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ]; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            echo "setup.sh: installing openssh-server (the ssh tests run a private sshd on loopback)" >&2
            export DEBIAN_FRONTEND=noninteractive
            apt-get install -y -qq openssh-server >/dev/null 2>&1 \
                || { apt-get update -qq >/dev/null && apt-get install -y -qq openssh-server >/dev/null; } \
                || { echo "setup.sh: could not install openssh-server; install it (sshd) and re-run" >&2; exit 3; }
        else
            echo "setup.sh: sshd not found and cannot install it here (not root or no apt-get): the ssh tests will be skipped; install openssh-server to run them" >&2
        fi
    fi
    shift
elif [ -n "${1:-}" ]; then
    echo "setup.sh: unknown argument '$1' (usage: ./setup.sh [--test])" >&2
    exit 2
fi
venv="${VENV:-.venv}"
py="${PYTHON:-python3}"
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup.sh: $py is $("$py" --version 2>&1); the kit needs Python >= 3.11 (set PYTHON=...)" >&2
    exit 2
fi
stamp="$venv/.kit-setup-stamp"
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "setup.sh: $venv is up to date" >&2
    exit 0
fi
echo "setup.sh: creating $venv and installing pinned dependencies (first run: about a minute)" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
if [ "${KIT_KEEP_TORCH:-0}" = 1 ]; then
    "$venv/bin/python" -m pip install -q --no-deps -e '.[test]' >&2
else
    "$venv/bin/python" -m pip install -q -e '.[test]' >&2
fi
echo "$want" > "$stamp"
echo "setup.sh: ready ($venv)" >&2
