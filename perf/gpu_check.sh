#!/usr/bin/env bash
# The one GPU check, within 8 minutes: perf/gpu_check.py does the work with the interpreter on the PATH (no
# venv, no download) and records every part's result instead of stopping at the first failure.
# Usage: perf/gpu_check.sh OUT_DIR [--cpu] [--no-install] [--only part,part] [--multi] [--peers]
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-python}" perf/gpu_check.py "${@:-/tmp/graphstep-gpu-check}"
