#!/usr/bin/env bash
# Set up the kit in ./.venv (idempotent): Python >= 3.11, pinned dependencies, the kit editable.
# VENV=path overrides the location. On a GPU machine, keep its CUDA torch: KIT_KEEP_TORCH=1.
set -euo pipefail
cd "$(dirname "$0")"
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
