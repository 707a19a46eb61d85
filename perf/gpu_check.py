"""The one GPU check: every claim graphstep makes about CUDA, settled in one run of at most 8 minutes on one GPU.

    perf/gpu_check.sh OUT_DIR                 # on the GPU machine, from any directory
    perf/gpu_check.sh OUT_DIR --cpu           # the dry run (CI runs exactly this)
    python perf/gpu_check.py OUT_DIR [--cpu] [--no-install] [--only part,part] [--multi] [--peers]

It runs on the machine as it is: the interpreter that starts it and that interpreter's torch. Nothing is
downloaded: graphstep is installed from the checkout without dependencies (``pip install --no-deps
--no-build-isolation --no-index -e .``, skipped where the checkout is already what ``import graphstep``
finds; a failed install is recorded, not fatal, as the parts put the checkout first on the path). What the
machine lacks (transformer-engine, a second GPU) makes the rows that need it skips with the reason.

The parts (perf/gpu_check_parts.py: order, time limits, expected times) run one after another in a worker
process (perf/gpu_check_runner.py), so a failing, hanging or crashing part costs only itself. The preflight
comes first: the versions found (torch, Triton, CUDA, driver, NCCL), the GPU, and every private torch name
graphstep uses (perf/gpu_check_torch_api.py), named where missing. Correctness comes before speed, so a
time cut falls on speed. Each row's result is printed as one line as it arrives; ``OUT_DIR/gpu_check.json``
(every check with status, detail and numbers; every part with exit code, wall time, limit and expected
time) and ``OUT_DIR/gpu_check.md`` are written at the end. Exit 0 only if no check failed or errored.

``--cpu`` is the dry run for a machine without a GPU (and for CI): the same script end to end on small
sizes over the CPU replay backend, every GPU-only row skipped with its reason. It refuses to start (exit 2)
when the parts' limits add up to more than the budget. ``--multi`` (>= 2 GPUs, or two gloo ranks with
``--cpu``) runs the multi-rank rows after the preflight; ``--peers``, the compiled peers' rows (their compiles
take minutes: a second run, when the machine's time allows).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from gpu_check_parts import (BY_NAME, INSTALL_LIMIT_S, MULTI_LIMIT_S, PARTS, PARTS_BUDGET_S, PEERS,  # noqa: E402
                             WHOLE_S, Part, budget_problem)
from gpu_check_runner import run_parts, worker_main  # noqa: E402

INSTALL = ["-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-e", "."]


def install(skip: bool) -> dict:
    """graphstep from the checkout, without dependencies and without the network."""
    if skip:
        return {"status": "skipped: --no-install"}
    spec = importlib.util.find_spec("graphstep")
    if spec is not None and spec.origin and Path(spec.origin).resolve().is_relative_to(ROOT):
        return {"status": "skipped: import graphstep already finds this checkout"}
    cmd = [sys.executable, *INSTALL]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=INSTALL_LIMIT_S)
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        code, tail = proc.returncode, [line for line in lines if "error:" in line][:3] + lines[-2:]
    except subprocess.TimeoutExpired:
        code, tail = "timeout", [f"pip did not finish within {INSTALL_LIMIT_S} s"]
    status = "pass" if code == 0 else "error (not fatal: the parts import graphstep from the checkout)"
    return {"status": status, "command": " ".join(cmd[1:]), "exit_code": code,
            "wall_s": round(time.perf_counter() - t0, 1), "output_tail": tail}


def markdown(summary: dict) -> str:
    lines = [f"# graphstep GPU check ({'CPU dry run' if summary['cpu'] else 'GPU'})", "",
             f"{summary['device']}; {summary['versions']}; install: {summary['install']['status']}; "
             f"{summary['wall_s']:.0f} s in all (budget {summary['budget_s']} s); {summary['counts']}", "",
             "| check | status | detail |", "|---|---|---|"]
    for r in summary["checks"]:
        lines.append(f"| {r['check']} | {r['status']} | {str(r['detail']).replace('|', '/')} |")
    lines += ["", "| part | exit code | wall s | limit s | expected s |", "|---|---|---:|---:|---:|"]
    lines += [f"| {p['part']} | {p['exit_code']} | {p.get('wall_s', '')} | {p.get('limit_s', '')} | "
              f"{p.get('estimate_s', '')} |" for p in summary["parts"]]
    return "\n".join(lines) + "\n"


def chosen_parts(args, parser) -> list[Part]:
    if args.peers:
        if args.multi or args.only is not None:
            parser.error("--peers runs the preflight and the peers' part alone: no --multi or --only with it")
        return [BY_NAME["preflight"], PEERS]
    if args.multi:
        return [BY_NAME["preflight"], dataclasses.replace(BY_NAME["multi"], limit_s=MULTI_LIMIT_S,
                                                          estimate_s=MULTI_LIMIT_S // 2)]
    if args.only is None:
        return list(PARTS)
    names = [p.strip() for p in args.only.split(",")]
    unknown = [p for p in names if p not in {part.name for part in PARTS}]
    if unknown:
        parser.error(f"--only: unknown part(s) {', '.join(unknown)}; choose from {', '.join(p.name for p in PARTS)}")
    return [part for part in PARTS if part.name in names]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--cpu", action="store_true", help="dry run without a GPU: GPU rows skipped, small sizes")
    parser.add_argument("--no-install", action="store_true", help="skip installing graphstep from the checkout")
    parser.add_argument("--only", default=None, help="comma-separated parts, of: " + ", ".join(p.name for p in PARTS))
    parser.add_argument("--multi", action="store_true",
                        help="the multi-rank rows (>= 2 GPUs; two gloo ranks with --cpu), after the preflight")
    parser.add_argument("--peers", action="store_true",
                        help="the compiled peers' rows (torch.compile'd AdamW, heavyball), after the preflight")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--progress", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker.split(","), Path(args.progress), args.cpu, args.multi)
    if not args.out:
        parser.error("give the output directory: perf/gpu_check.sh OUT_DIR")
    parts = chosen_parts(args, parser)
    problem = budget_problem(PARTS)
    if problem:
        print(f"gpu_check: refused: {problem}", file=sys.stderr)
        return 2
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"cpu": args.cpu, "install": install(args.no_install), "parts": [], "checks": []}
    preflight_s = BY_NAME["preflight"].limit_s
    budget = (MULTI_LIMIT_S + preflight_s if args.multi else PEERS.limit_s + preflight_s if args.peers
              else PARTS_BUDGET_S)
    print(f"gpu_check: {len(parts)} parts, limits {sum(p.limit_s for p in parts)} s of {budget} s, expected "
          f"{sum(p.estimate_s for p in parts)} s on one H100; install: {summary['install']['status']}", flush=True)

    def on_part(part: dict, checks: list[dict]) -> None:
        summary["parts"].append(part)
        summary["checks"] += checks
        spec = next(p for p in parts if p.name == part["part"])
        print(f"[{part['part']}] {part.get('wall_s', '-')} s (limit {spec.limit_s} s, expected ~{spec.estimate_s} s: "
              f"{spec.estimate_why})", flush=True)
        for c in checks:
            print(f"  {c['status']:<8} {c['check']}: {str(c['detail'])[:200]}", flush=True)

    run_parts(parts, args.cpu, time.monotonic() + budget, args.multi, on_part)
    names = {p.name for p in parts}
    for part in (*PARTS, PEERS):  # every row is listed: a part left out by --only, --multi or --peers says so
        if part.name not in names:
            why = {"multi": "skipped: multi-rank rows run with --multi",
                   "peers": "skipped: the compiled peers run with --peers"}.get(part.name, "skipped: not chosen")
            for c in part.checks:
                summary["checks"].append({"check": c, "status": why, "detail": "", "numbers": {}, "part": part.name})
                print(f"  {why} {c}:", flush=True)
    preflight = next((c for c in summary["checks"] if c["check"] == "preflight"), {"numbers": {}})
    facts = preflight["numbers"]
    summary["device"] = facts.get("device", "device unknown (the preflight did not run)")
    summary["versions"] = ", ".join(f"{k} {facts.get(k, '?')}" for k in ("python", "torch", "triton", "cuda_build",
                                                                         "driver", "nccl"))
    statuses = [c["status"] for c in summary["checks"]]
    summary["counts"] = ", ".join(f"{statuses.count(s)} {s}" for s in ("pass", "fail", "error"))
    summary["counts"] += f", {sum(s.startswith('skipped') for s in statuses)} skipped"
    summary["wall_s"] = time.monotonic() - started
    summary["budget_s"], summary["whole_s"] = budget, WHOLE_S
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(summary))
    print(f"gpu_check: {summary['counts']} in {summary['wall_s']:.0f} s; wrote {out / 'gpu_check.json'} and "
          f"{out / 'gpu_check.md'}", flush=True)
    return 1 if any(s in ("fail", "error") for s in statuses) else 0


if __name__ == "__main__":
    sys.exit(main())
