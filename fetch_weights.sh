#!/usr/bin/env bash
# fetch_weights.sh: download the GLM-5.3 EXL3 checkpoint and prove it complete before anything loads it.
#
#   bash fetch_weights.sh [--repo ID] [--revision REV] [--dir PATH] [--offline] [--deep]
#                         [--workers N] [--json FILE]
#   bash fetch_weights.sh --drafter [--dir PATH] [--revision REV] [--accept-licence] [--offline] [--json FILE]
#
# A thin front over `python -m glm53.checkpoints` (run `bash fetch_weights.sh --help` for the flags).
# --drafter fetches the DFlash2 drafter named by drafter/MANIFEST.json (CC BY-NC-ND 4.0: asks you to
# accept the licence, or --accept-licence when stdin is not a terminal), pins it against the hub's
# sizes and SHA-256 (PATH/drafter.lock.json) and verifies it; with --offline it re-verifies it.
# Exit codes: 0 complete and valid; 1 file problems (missing/truncated/LFS pointer/bad header/
# size or hash mismatch); 2 usage; 3 tensors do not match config.json; 4 no checkpoint (offline or
# hub unreachable with no local copy, repo/revision not found, download failed); 5 the drafter's
# licence was not accepted (nothing downloaded); 130 interrupted.
# Environment: PYTHON (default: .venv/bin/python beside this script, else python3), HF_ENDPOINT,
# HF_TOKEN, HF_HOME / HF_HUB_CACHE (where the default download goes), HF_HUB_OFFLINE=1.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$here/.venv/bin/python" ]]; then PYTHON="$here/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
export GLM53_WEIGHTS_PROG="bash fetch_weights.sh"
exec "$PYTHON" -m glm53.checkpoints "$@"
