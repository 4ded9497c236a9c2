#!/usr/bin/env bash
# Start the GLM-5.3 lane and return when it is READY (or fail with the failing rank's log tail).
#   bash serve.sh [--cluster FILE | --local] [--model DIR] [--ranks R] [--port P] [--host ADDR] [--context N]
#   bash serve.sh stop [--port P]        stop every rank; logs are kept (.work/lanes/PORT/)
#   bash serve.sh restart [options]      check the new settings, then replace the running lane
#   bash serve.sh status [--port P]      the lane's state
#   DRY_RUN=1 bash serve.sh ...          print the plan and every command on every node; change nothing
# Without a cluster file ($GLM53_CLUSTER or --cluster) the lane runs here on the tiny checkpoint.
# Exit codes: 0 READY/stopped, 1 start failed, 2 usage, 3 preflight, 4 memory plan, 5 port busy.
set -euo pipefail
kit="$(cd "$(dirname "$0")" && pwd)"
py="${GLM53_PYTHON:-$kit/.venv/bin/python}"
[ -x "$py" ] || { echo "serve.sh: $py not found: run ./setup.sh first (or set GLM53_PYTHON)" >&2; exit 2; }
cmd=serve
case "${1:-}" in
    stop|restart|status|check|prepare) cmd="$1"; shift ;;
esac
cd "$kit"
exec "$py" -m launcher "$cmd" "$@"
