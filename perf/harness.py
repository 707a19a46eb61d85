"""The perf harness: graphstep against torch's optimizer pipelines, one process per row, in one command.

    python perf/harness.py [--quick] [--out perf/results] [--repeat 3] [--no-distributed] [--no-compile]

Rows (every one in its own spawned interpreter, so memory, threads and compile caches never leak):

- ``stream``: ``x.mul_(1.0001)`` over a 512 MB buffer, far beyond the last-level cache, 8 B/elem (r + w):
  this machine's in-place bandwidth, measured at the start and the end of the run (the best is used);
- ``graphstep-eager`` / ``graphstep-captured``: the engine's full step (static loss scale 1024 folded into
  the update, non-finite check, global-norm clip 1.0, fused fp32 AdamW), ``capture="eager"`` / ``"graph"``
  (the CPU replay backend here, a CUDA graph on a GPU);
- ``graphstep-compiled``: the captured full step with ``kernel="compiled"`` (one compiled loop that reads
  the grads without writing them back; compiled during warm-up);
- ``torch-foreach`` / ``torch-fused``: ``torch.amp.GradScaler.unscale_`` + ``clip_grad_norm_(1.0)`` +
  ``scaler.step(AdamW(foreach|fused))`` + ``scaler.update()``, the idiomatic torch AMP step;
- ``torch-compiled``: the same with ``clip_grad_norm_`` + ``AdamW(foreach).step`` under ``torch.compile``
  (unscale_ and the skip-on-inf check stay GradScaler's), compiled during warm-up, its time capped.

Byte model (bytes each pipeline must move per fp32 param and step, docs/design.md §6): Adam reads param, grad,
m, v and writes param, m, v: 28 B. graphstep adds one grad read for the norm (which is also the inf
check; unscale and clip are folded into the update's grad_scale): 32 B (the fused kernel, which the
graphstep-eager and -captured rows name explicitly, also writes the divided grads back, 4 B beyond the model
and charged as slowness; kernel="compiled", which the default kernel="auto" picks where torch.compile works,
does not).
torch's pipeline adds unscale_ (read + write grads, 8 B), the clip norm (read, 4 B) and the clip multiply
(read + write, 8 B): 48 B. The torch-compiled row is charged the same 48 B: it runs the same program,
whatever inductor fuses. GB/s is those
bytes over the median step time; "% BW" divides it by the stream bandwidth; the floor of a row is its
bytes over the stream bandwidth.

Between timed steps the grads are refilled from a source copy (untimed): unscale_ and the clip rewrite
them in place, and repeated unscaling would drive them into denormals. Ops/step: aten ops seen by a
``TorchDispatchMode`` around one step (for the captured row, the replayed ops; inductor's kernels are
invisible to it: the compiled row reports the kernels inductor generated instead, in its notes).
Optimizer B/param: optimizer-owned tensor bytes (state, fp32 master copies, flat-buffer padding, beyond
the model's own params and grads) over the param count.

Shapes: GPT-2 small (124M params, 148 tensors), many small tensors (10,000 x 4,096), one flat tensor
(64M); sweeps for the plots: flat tensors of 1M-64M params, and 150 / 1,000 / 10,000 tensors at ~16M
params in all. ``--quick`` divides the sizes by 8 (GPT-2 becomes graphstep/app/bench_shapes.py's gpt2-quick; the
many-small shape keeps its 10,000 tensors at 512 elements), times fewer steps, one round, drops a flat sweep point
and the eager row of the tensor sweep, and caps compiles at 30 s.

The machine may be shared: a neighbour process preempting one of torch's two threads stalls every
parallel kernel, so ``--repeat N`` runs each row N times round-robin and keeps its fastest run, and the
1-min load average before each row is recorded. On CUDA the same command times
with CUDA events. Writes ``results.json``, ``results.md`` (also printed) and two PNGs under ``--out``.
Never imported by the library or the tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # the checkout's graphstep (its app holds the benchmark core), not an installed one
from graphstep.app import bench_core as core  # noqa: E402
from graphstep.app import bench_shapes  # noqa: E402
from graphstep.app import bench_stats  # noqa: E402
from harness_report import (LABELS, STREAM_BYTES, GRAPHSTEP_BYTES, TORCH_AMP_BYTES,  # noqa: E402
                            add_derived, done_when_checks, machine_info, markdown)

MAIN_PIPELINES = ["graphstep-eager", "graphstep-captured", "graphstep-compiled", "torch-foreach", "torch-fused",
                  "torch-compiled"]
GRAD_STD = 1e-3  # the unscaled grads; the buffers hold them times the loss scale


# ---- shapes: (name, shape) lists; the worker builds tensors from them ------------------------------------
def shape_plan(quick: bool) -> dict:
    """Every shape the run needs, by name: the three main ones and the two sweeps."""
    div = 8 if quick else 1
    gpt2 = bench_shapes.gpt2_quick() if quick else bench_shapes.gpt2_small()
    plan = {"gpt2": gpt2, "many-small": bench_shapes.many_tensors(10_000, 4096 // div),
            "flat": bench_shapes.flat_tensor(64 * 2**20 // div)}
    for numel in ((4 * 2**20, 16 * 2**20) if quick else (2**20, 4 * 2**20, 16 * 2**20)):
        plan[f"flat-{numel // div // 1024}K"] = bench_shapes.flat_tensor(numel // div)
    for count in (150, 1_000, 10_000):
        plan[f"tensors-{count}"] = bench_shapes.many_tensors(count, 16 * 2**20 // div // count)
    return plan


def numel_of(shapes: list) -> int:
    return sum(math.prod(shape) for _, shape in shapes)


# ---- worker side: build one pipeline, time it, count its ops, measure its memory -------------------------
def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_bytes(pipeline: "core.Pipeline", model_bytes: int) -> int:
    """Optimizer-owned tensor bytes: state, fp32 master copies and flat-buffer padding beyond the model's
    own params and grads."""
    opt = pipeline.optimizer
    if isinstance(opt, torch.optim.AdamW):
        return tensor_bytes(t for state in opt.state.values() for t in state.values())
    device = opt.memory_stats()["device"]  # graphstep.run.memory: each storage once, aliases not twice
    owned = device["total"] - sum(device.get(kind, 0) for kind in ("params", "grads", "scalars", "graph_pool"))
    return owned + device["params"] - model_bytes + device["grads"] - model_bytes


def build_row(spec: dict, device) -> tuple["core.Pipeline", int]:
    """The row's pipeline and its param count. graphstep's full step runs with a static loss scale, so it
    does the torch pipeline's work: unscale, inf check, clip, AdamW."""
    pipeline = spec["pipeline"]
    if pipeline == "stream":
        return core.build_stream(spec["numel"], device), spec["numel"]
    shapes = [(n, tuple(s)) for n, s in spec["shapes"]]
    inputs = core.Inputs(shapes, device, seed=0, grad_std=GRAD_STD * core.LOSS_SCALE)
    if pipeline.startswith("graphstep"):
        built = core.build_graphstep(inputs, capture="eager" if pipeline == "graphstep-eager" else "graph",
                                     loss_scale=core.LOSS_SCALE,
                                     kernel="compiled" if pipeline == "graphstep-compiled" else "fused")
    else:
        built = core.build_torch_amp(inputs, variant=pipeline.removeprefix("torch-"))
    return built, inputs.numel


def time_row(built: "core.Pipeline", device, warmup: int, steps: int, repeat: int) -> dict:
    """Median/p10/p90 ms of the block (of ``repeat`` blocks of ``steps``) with the lowest median; the grads
    are refilled, untimed, before every step (unscale_ and the clip rewrite them in place)."""
    t0 = time.perf_counter()
    core.time_steps(built.step, device, warmup, 0, before=built.refill)
    warmup_s = time.perf_counter() - t0
    blocks = [core.time_steps(built.step, device, 0, steps, before=built.refill) for _ in range(repeat)]
    best = min(blocks, key=statistics.median)
    return {**bench_stats.summarize(best), "times_ms": best, "warmup_s": warmup_s}


def worker(spec: dict) -> dict:
    """Run one row in this (fresh) process and return its numbers."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = core.pick_device()
    pipeline = spec["pipeline"]
    with torch.no_grad():
        t0 = time.perf_counter()
        built, numel = build_row(spec, device)
        build_s = time.perf_counter() - t0
        result = time_row(built, device, spec["warmup"], spec["steps"], spec["repeat"])
        result["warmup_s"] += build_s  # the capture (and a compile) happen while building
        ops, ops_note = core.count_ops(built) if pipeline != "stream" else (1, "")
    opt_bytes = 0 if built.optimizer is None else optimizer_bytes(built, 4 * numel)
    notes = [n for n in (built.notes, ops_note) if n]
    if pipeline == "torch-compiled":
        from torch._inductor import metrics
        notes.append(f"inductor generated {metrics.generated_kernel_count} kernels")
    result.update(numel=numel, tensors=len(spec.get("shapes") or [0]), ops_per_step=ops,
                  opt_bytes_per_param=opt_bytes / numel, notes="; ".join(notes), device=str(device),
                  threads=torch.get_num_threads())
    del built
    gc.collect()
    return result


# ---- driver side: spawn the workers, compute the derived columns ----------------------------------------
def run_worker(spec: dict, timeout_s: float) -> dict:
    """One row in a fresh interpreter; a failure or a timeout becomes the row's ``error``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        spec_path = Path(tmp) / "spec.json"  # a file, not argv: 10,000 shapes overflow the argument list
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), "--worker-out", str(out)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"error": f"did not finish within {timeout_s:.0f} s"
                    + (" (compile included: see --compile-cap)" if spec["pipeline"] == "torch-compiled" else "")}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"error": f"exit {proc.returncode}: {tail[0][:200]}"}
        result = json.loads(out.read_text())
        result["process_s"] = wall
        return result


def row_specs(plan: dict, args) -> list[dict]:
    """What to run: every main pipeline on the three main shapes, then the sweeps (only the pipelines
    each plot needs; the largest flat sweep point is the main flat shape itself)."""
    rows = []
    main = [p for p in MAIN_PIPELINES if p != "torch-compiled" or args.compile]
    for shape in ("gpt2", "many-small", "flat"):
        rows += [(shape, p) for p in main]
    for shape in plan:
        if shape.startswith("flat-"):
            rows += [(shape, p) for p in ("graphstep-captured", "torch-fused")]
        elif shape.startswith("tensors-"):
            sweep = ("graphstep-captured", "torch-fused") if args.quick else (
                "graphstep-eager", "graphstep-captured", "torch-fused")
            rows += [(shape, p) for p in sweep]
    return [{"shape": s, "pipeline": p, "shapes": plan[s], "warmup": args.warmup, "steps": args.steps,
             "repeat": args.repeat, "threads": args.threads} for s, p in rows]


def run_rounds(specs: list[dict], args) -> list[dict]:
    """Every row ``--repeat`` times, round-robin, each in a fresh process, keeping each row's fastest run
    (lowest median): neighbours on a shared machine come and go over seconds, so spreading a row's tries
    over the run beats timing it longer. A compiled row runs once (its compile is the cost), timing
    ``--repeat`` blocks in that process instead."""
    best: dict[int, dict] = {}
    for round_index in range(args.repeat):
        for index, spec in enumerate(specs):
            compiled = spec["pipeline"] == "torch-compiled"
            if compiled and round_index > 0:
                continue
            load = os.getloadavg()[0]  # the machine is shared: a busy neighbour slows 2-thread kernels a lot
            print(f"[{round_index + 1}/{args.repeat}] {spec['shape']} / {spec['pipeline']} (load {load:.1f}) ...",
                  end="", file=sys.stderr, flush=True)
            result = run_worker({**spec, "repeat": args.repeat if compiled else 1},
                                args.compile_cap if compiled else 900)
            result["loadavg_before"] = load
            print(f" {result.get('median_ms', float('nan')):.2f} ms {result.get('error', '')}", file=sys.stderr)
            kept = best.get(index)
            if kept is None or "error" in kept or ("error" not in result and result["median_ms"] < kept["median_ms"]):
                best[index] = {**result, "round": round_index + 1}
    return [{"shape": s["shape"], "pipeline": s["pipeline"], "label": LABELS[s["pipeline"]],
             "numel": numel_of(s["shapes"]), "tensors": len(s["shapes"]), **best[i]} for i, s in enumerate(specs)]


def measure_bandwidth(args, when: str) -> dict:
    spec = {"shape": "stream", "pipeline": "stream", "numel": args.stream_numel, "warmup": 3,
            "steps": max(10, args.steps), "repeat": args.repeat, "threads": args.threads}
    result = run_worker(spec, 300)
    if "error" not in result:
        result["gbps"] = STREAM_BYTES * args.stream_numel / (result["median_ms"] * 1e-3) / 1e9
    print(f"stream ({when}): {result.get('gbps', float('nan')):.1f} GB/s {result.get('error', '')}", file=sys.stderr)
    return {"when": when, **result}


# ---- distributed rows: bench_distributed.py's table, parsed ---------------------------------------------
def run_distributed(quick: bool, timeout_s: float) -> dict:
    """bench_distributed.py in its own process (it spawns its gloo ranks); its markdown rows, parsed."""
    extra = ["--world-sizes", "2", "--width", "256", "--layers", "4", "--iters", "5"] if quick else []
    cmd = [sys.executable, str(HERE / "bench_distributed.py"), *extra]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"bench_distributed.py did not finish within {timeout_s:.0f} s", "rows": []}
    if proc.returncode != 0:
        return {"error": f"bench_distributed.py exit {proc.returncode}: {proc.stderr.strip()[-300:]}", "rows": []}
    lines = proc.stdout.strip().splitlines()
    header = next((line for line in lines if line.startswith("| ranks")), None)
    keys = [c.strip() for c in header.strip("|").split("|")] if header else []
    rows = [dict(zip(keys, (c.strip() for c in line.strip("|").split("|"))))
            for line in lines if line.startswith("| ") and line != header and not line.startswith("|--")]
    return {"command": " ".join(cmd[1:]), "title": lines[0] if lines else "", "columns": keys, "rows": rows}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="harness", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sizes / 8, fewer steps: under ~3 minutes")
    parser.add_argument("--out", default=str(HERE / "results"), help="where JSON, markdown and PNGs go")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per block (default 20, quick 8)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (plus the capture's own)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="rounds: every row runs this many times, round-robin, each in a fresh process, and "
                             "keeps its lowest-median run; steadier on a shared machine (default 2, quick 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in every row")
    parser.add_argument("--compile-cap", type=float, default=None,
                        help="seconds a torch-compiled row may take in all, compile included (default 180, "
                             "quick 30)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile rows")
    parser.add_argument("--no-distributed", dest="distributed", action="store_false",
                        help="skip perf/bench_distributed.py")
    parser.add_argument("--only-shapes", default=None, help="comma-separated shape names to run (debugging)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (8 if args.quick else 20)
    args.repeat = args.repeat or (1 if args.quick else 2)
    args.compile_cap = args.compile_cap or (30.0 if args.quick else 180.0)
    # 512 MB: lscpu says 32 MB of L3, yet a 128 MB buffer streamed at 57-67 GB/s here (a host cache larger
    # than the VM reports); 256 MB and up settle at ~30-37 GB/s.
    args.stream_numel = 128 * 2**20
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(worker(json.loads(Path(args.worker).read_text()))))
        return 0
    started = time.perf_counter()
    plan = shape_plan(args.quick)
    specs = row_specs(plan, args)
    if args.only_shapes:
        keep = set(args.only_shapes.split(","))
        specs = [s for s in specs if s["shape"] in keep]
    bandwidth = [measure_bandwidth(args, "start")]
    rows = run_rounds(specs, args)
    bandwidth.append(measure_bandwidth(args, "end"))
    best_bw = max((b["gbps"] for b in bandwidth if "gbps" in b), default=float("nan"))
    add_derived(rows, best_bw)
    checks = done_when_checks(rows, plan)
    distributed = run_distributed(args.quick, 600) if args.distributed else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine_info(bandwidth), "bandwidth": bandwidth, "bandwidth_gbps": best_bw,
            "args": {k: v for k, v in vars(args).items() if not k.startswith("worker")},
            "byte_model": {"graphstep": GRAPHSTEP_BYTES, "torch_amp_pipeline": TORCH_AMP_BYTES, "stream": STREAM_BYTES},
            "wall_s": None, "load": [min(r["loadavg_before"] for r in rows), max(r["loadavg_before"] for r in rows)]}
    from plots import write_plots
    meta["plots"] = [str(p) for p in write_plots(rows, best_bw, out)]
    meta["wall_s"] = time.perf_counter() - started
    for r in rows:
        r.pop("shapes", None)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows, "checks": checks,
                                                  "distributed": distributed}, indent=1))
    text = markdown(rows, checks, distributed, meta, args)
    (out / "results.md").write_text(text)
    print(text)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {', '.join(meta['plots'])} "
          f"in {meta['wall_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
