#!/usr/bin/env bash
# The GPU checks in one short command (a few minutes on one H200), for a machine that has a GPU:
# the CUDA-only tests (skipped on CPU), then captured versus eager and the step benchmark on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/graphstep-gpu}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -m pytest -q -m cuda tests/cuda 2>&1 | tee "$out/pytest-cuda.txt"
python perf/bench_capture.py --tensors 1000 --numel 4096 --json "$out/bench_capture.json" | tee "$out/bench_capture.md"
if [ -f perf/bench_step.py ]; then
  python perf/bench_step.py --json "$out/bench_step.json" | tee "$out/bench_step.md"
fi
python perf/harness.py --no-compile --out "$out/harness" | tee "$out/harness.md"
