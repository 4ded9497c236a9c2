#!/usr/bin/env bash
# Check a real completion from a running lane (not just /health):
#   bash verify.sh [--url http://127.0.0.1:8300[/v1]] [--timeout S] [--max-tokens N] [--api-key KEY]
# Checks: models, completion (content, finish reason, usage), repeat (temperature 0 twice, same text),
# draft ("draft": false gives the same text), cached (an extended resend reports cached tokens),
# stream (SSE gives the same text). Each failure names the check and why.
# Exit codes: 0 all passed (or skipped with the reason the server gave), 1 a check failed, 2 no server.
set -euo pipefail
kit="$(cd "$(dirname "$0")" && pwd)"
py="${GLM53_PYTHON:-$kit/.venv/bin/python}"
[ -x "$py" ] || { echo "verify.sh: $py not found: run ./setup.sh first (or set GLM53_PYTHON)" >&2; exit 2; }
cd "$kit"
exec "$py" -m launcher.verify "$@"
