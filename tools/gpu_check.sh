#!/usr/bin/env bash
# One command, no downloads: bash tools/gpu_check.sh [--tiny] [--out FILE]
# (see tools/gpu_check.py). The whole check is bounded at 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 "$PY" tools/gpu_check.py "$@"
