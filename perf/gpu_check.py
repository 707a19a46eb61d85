"""The one GPU check: every claim graphstep makes about CUDA, settled in one run within BUDGET_S on one GPU.

    python perf/gpu_check.py OUT_DIR [--no-install] [--cpu] [--only part,part] [--multi]
    perf/gpu_check.sh OUT_DIR          # the same, from any directory

It installs the project from its own files (``pip install -e ".[test]"``; ``--no-install`` skips that),
then runs each part in its own process with a time limit, so a failing, hanging or crashing part
costs only itself: its exit code and its checks' results are recorded and the run goes on. It writes
``OUT_DIR/gpu_check.json`` (every check with its status, detail and numbers; every part with its exit
code and wall time) and ``OUT_DIR/gpu_check.md``, and exits 0 only if no check failed or errored.

The parts (check names in the JSON), in the order they run: what settles correctness first, so that a
budget cut (a part that would start with too little time left is recorded as not run) falls on speed:

- preflight: torch / CUDA / NCCL / Triton / driver versions, the GPU, MIG mode, allocator and NCCL
  settings; then every compile the step's first call would do with the options it uses (the compiled
  Adam with the step's hyperparameter dtype, a scalar graph), failing here rather than in step 1;
- cuda-tests: ``pytest -m cuda tests/cuda``;
- bitwise: eager vs captured over 30 steps with an LR schedule and one inf step, fp32/bf16/fp16 x
  kernel fused/compiled: params, every state tensor, step, loss scale, grad norm and found_inf equal,
  ``recaptures == 0``; then replays under ``torch.cuda.set_sync_debug_mode("error")``;
- recapture: a param's ``.data`` replaced after capture: one recapture, still equal to eager;
- speed: kernels per replay at 150 / 1,000 / 10,000 tensors of one total size (torch.profiler; equal
  counts expected); the captured step over 10,000 small tensors against the captured step over one flat
  tensor of the same size (same bytes moved; goal <= 1.15x), with eager and host time per call reported;
  the flat 64M-param step against the bytes its kernel moves at the measured HBM bandwidth (32 B/param
  for the compiled kernel, 36 B with the fused one, which writes the grads back; goal <= 1.15x);
- fold: ``fold_grad_norm`` (the default) at GPT-2 small, captured: the folded step against one flat
  ``_fused_adamw_`` (goal: within 1.05x of the byte ratio, 28 or 32 B against 28), backward (a stand-in) +
  step against the unfolded pair (goal: faster), and torch's AMP step (48 B/param) and clip_grad_norm_ +
  AdamW(fused) (40 B) against it (goals: at least 0.9x the byte ratio);
- memory: CUDA memory flat across 10 recaptures;
- pinned-thread: capture while another thread pins host memory and copies from it;
- nccl: a world-size-1 NCCL group capturing reduce-scatter / all-gather / all-reduce (the distributed
  optimizer needs two ranks to run a collective at all: ``--multi``);
- profile-cli: ``graphstep profile --capture graph`` on CUDA: kernel events in the trace, NVML telemetry;
- families: Muon, fp8 params and CPU offload, only where ``OptimizerConfig`` accepts them;
- offload: hybrid CPU offload (perf/gpu_check_offload.py): eager vs captured, against no offload, the
  overlapped host update, pinned buffers and the device bytes saved;
- multi (``--multi``, on a machine with >= 2 GPUs; skipped with the reason on one): perf/gpu_check_multi.py,
  the distributed optimizer captured vs eager over NCCL, teardown with a captured step held, a dead peer.

``--cpu`` is the dry run for a machine without a GPU (and for CI): the same script end to end, every
GPU-only check recorded as ``skipped: no CUDA``, the rest on small sizes over the CPU replay backend.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NO_CUDA = "skipped: no CUDA"
BUDGET_S = 470  # the whole run, install included: what one 10-minute device command leaves after start-up
MULTI = "multi"

# part: (module, function, runs without CUDA, time limit in s, the check names it reports)
PARTS = {
    "preflight": ("gpu_check_env", "part_preflight", True, 60, ["preflight"]),
    "cuda-tests": ("gpu_check_env", "part_cuda_tests", False, 240, ["pytest-tests-cuda"]),
    "bitwise": ("gpu_check_numerics", "part_bitwise", True, 240,
                [f"bitwise-{p}-{k}" for p in ("fp32", "bf16", "fp16") for k in ("fused", "compiled")]
                + ["bitwise-negative-control", "replay-without-host-sync"]),
    "recapture": ("gpu_check_numerics", "part_recapture", True, 90, ["forced-recapture"]),
    "speed": ("gpu_check_speed", "part_speed", True, 120,
              ["captured-10k-tensors-vs-flat", "cpu-time-per-replay", "flat-64M-vs-hbm-floor"]),
    "kernels": ("gpu_check_speed", "part_kernels", True, 120, ["kernels-per-replay-independent-of-tensor-count"]),
    "fold": ("gpu_check_speed", "part_fold", True, 180,
             ["fold-step-vs-fused-floor", "fold-backward-plus-step", "default-step-vs-torch-amp",
              "default-step-vs-adamw-fused-clip"]),
    "memory": ("gpu_check_numerics", "part_memory", False, 60, ["memory-flat-over-10-recaptures"]),
    "pinned-thread": ("gpu_check_numerics", "part_pinned_thread", False, 60, ["capture-with-pinned-memory-thread"]),
    "nccl": ("gpu_check_numerics", "part_nccl", False, 90, ["nccl-world1-collectives-captured"]),
    "profile-cli": ("gpu_check_env", "part_profile_cli", False, 120, ["graphstep-profile-capture-graph"]),
    "families": ("gpu_check_numerics", "part_families", True, 120, ["family-muon", "family-fp8", "family-offload",
                                                                  "family-precision-aware"]),
    "offload": ("gpu_check_offload", "part_offload", True, 120,
                ["offload-eager-vs-captured", "offload-vs-device-only", "offload-overlap",
                 "offload-pinned-and-memory"]),
    MULTI: ("gpu_check_multi", "part_multi", True, 240,
            ["multi-captured-step-matches-eager", "multi-teardown-after-capture", "multi-dead-peer-bounded"]),
}


def install(skip: bool) -> dict:
    """``pip install -e ".[test]"`` from the checkout, and once more without build isolation if that fails
    (a GPU machine without network cannot fetch setuptools). The parts put the checkout first on the
    path anyway, so a failed install is recorded, not fatal."""
    if skip:
        return {"status": "skipped: --no-install"}
    tries = []
    for extra in ([], ["--no-build-isolation"]):
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--retries", "1", "--timeout", "15", *extra,
               "-e", ".[test]"]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
            code, tail = proc.returncode, (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            code, tail = "timeout", ["pip did not finish within 120 s"]
        tries.append({"command": " ".join(cmd[2:]), "exit_code": code, "wall_s": round(time.perf_counter() - t0, 1),
                      "output_tail": tail})
        if code == 0:
            return {"status": "pass", "tries": tries}
    return {"status": "error", "tries": tries}


def run_part(name: str, cpu: bool, seconds_left: float) -> tuple[dict, list[dict]]:
    """One part in a fresh interpreter; a crash or a timeout becomes an "error" on each of its checks."""
    _, _, cpu_ok, limit, checks = PARTS[name]
    limit = min(limit, int(seconds_left))
    if limit < 5:
        return {"part": name, "exit_code": None, "status": "not run: time budget spent"}, \
               [{"check": c, "status": "error", "detail": f"not run: the {BUDGET_S} s budget was spent",
                 "numbers": {}, "part": name} for c in checks]
    if cpu and not cpu_ok:
        return {"part": name, "exit_code": None, "status": NO_CUDA}, \
               [{"check": c, "status": NO_CUDA, "detail": "", "numbers": {}, "part": name} for c in checks]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "part.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run-part", name, "--part-out", str(out)]
        cmd += ["--cpu"] if cpu else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
            code, tail = proc.returncode, (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        except subprocess.TimeoutExpired:
            code, tail = "timeout", [f"did not finish within {limit} s"]
        wall = round(time.perf_counter() - t0, 1)
        results = json.loads(out.read_text()) if out.exists() else []
    reported = {r["check"] for r in results}
    why = f"part {name} exit {code}: {tail[-1] if tail else 'no output'}"
    results += [{"check": c, "status": "error", "detail": why, "numbers": {}} for c in checks if c not in reported]
    for r in results:
        r["part"] = name
    return {"part": name, "exit_code": code, "wall_s": wall, "output_tail": tail}, results


def part_main(name: str, out: Path, cpu: bool) -> int:
    """Inside the part's own process: run it, write its records, exit 1 if any check failed."""
    import importlib

    import torch

    sys.path.insert(0, str(HERE))
    from graphstep.app.bench_core import pick_device

    device = torch.device("cpu") if cpu else pick_device()
    module, function = PARTS[name][:2]
    try:
        results = getattr(importlib.import_module(module), function)(device, cpu)
    except Exception as error:  # the whole part broke: every check it owns says so
        results = [{"check": c, "status": "error", "detail": f"{type(error).__name__}: {error}", "numbers": {}}
                   for c in PARTS[name][4]]
    out.write_text(json.dumps(results, default=str))
    return 1 if any(r["status"] in ("fail", "error") for r in results) else 0


def markdown(summary: dict) -> str:
    lines = [f"# graphstep GPU check ({'CPU dry run' if summary['cpu'] else 'GPU'})", "",
             f"{summary['device']}; install: {summary['install']['status']}; {summary['wall_s']:.0f} s in all; "
             f"{summary['counts']}", "", "| check | status | detail |", "|---|---|---|"]
    for r in summary["checks"]:
        lines.append(f"| {r['check']} | {r['status']} | {str(r['detail']).replace('|', '/')} |")
    lines += ["", "| part | exit code | wall s |", "|---|---|---:|"]
    lines += [f"| {p['part']} | {p['exit_code']} | {p.get('wall_s', '')} |" for p in summary["parts"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--cpu", action="store_true", help="dry run without a GPU: GPU checks skipped, small sizes")
    parser.add_argument("--no-install", action="store_true", help="skip pip install -e '.[test]'")
    parser.add_argument("--only", default=None, help="comma-separated parts, of: " + ", ".join(PARTS))
    parser.add_argument("--multi", action="store_true",
                        help="the multi-rank part (>= 2 GPUs; two gloo ranks with --cpu), after the preflight")
    parser.add_argument("--run-part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_part:
        return part_main(args.run_part, Path(args.part_out), args.cpu)
    if not args.out:
        parser.error("give the output directory: python perf/gpu_check.py OUT_DIR")
    if args.multi:
        parts = ["preflight", MULTI]
    elif args.only is None:
        parts = [p for p in PARTS if p != MULTI]
    else:
        parts = [p.strip() for p in args.only.split(",")]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--only: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"cpu": args.cpu, "install": install(args.no_install), "parts": [], "checks": []}
    for name in parts:
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        part, checks = run_part(name, args.cpu, BUDGET_S - (time.perf_counter() - started))
        summary["parts"].append(part)
        summary["checks"] += checks
        for c in checks:
            print(f"  {c['status']:<8} {c['check']}: {str(c['detail'])[:160]}", file=sys.stderr, flush=True)
    if MULTI not in parts:
        summary["checks"] += [{"check": c, "status": "skipped: multi-rank, run with --multi on >= 2 GPUs",
                               "detail": "", "numbers": {}, "part": MULTI} for c in PARTS[MULTI][4]]
    preflight = next((c for c in summary["checks"] if c["check"] == "preflight"), {"numbers": {}})
    summary["device"] = preflight["numbers"].get("device", "device unknown (preflight did not run)")
    statuses = [c["status"] for c in summary["checks"]]
    summary["counts"] = ", ".join(f"{statuses.count(s)} {s}" for s in ("pass", "fail", "error"))
    summary["counts"] += f", {sum(s.startswith('skipped') for s in statuses)} skipped"
    summary["wall_s"] = time.perf_counter() - started
    summary["budget_s"] = BUDGET_S
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(summary))
    print(f"gpu_check: {summary['counts']} in {summary['wall_s']:.0f} s; wrote {out / 'gpu_check.json'} and "
          f"{out / 'gpu_check.md'}", file=sys.stderr)
    return 1 if any(s in ("fail", "error") for s in statuses) else 0


if __name__ == "__main__":
    sys.exit(main())
