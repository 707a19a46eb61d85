#!/usr/bin/env bash
# The one GPU check (within perf/gpu_check.py's BUDGET_S): perf/gpu_check.py does the work and records every
# part's result instead of stopping at the first failure.
# Usage: perf/gpu_check.sh OUT_DIR [--no-install] [--cpu] [--multi]
cd "$(dirname "$0")/.." || exit 2
exec python perf/gpu_check.py "${@:-/tmp/graphstep-gpu-check}"
