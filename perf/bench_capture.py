"""Captured versus eager: the engine's full step on many small tensors, side by side in one process.

On a GPU the captured step is one graph launch against dozens of kernel launches eagerly; on the CPU
the replay backend skips Python but not the kernels. Reports ms/step (median, p10, p90) and the ops
dispatched per step (counted with a dispatch mode: a proxy for kernel launches; a CUDA graph's replayed
kernels are invisible to it, perf/gpu_check.py counts them with torch.profiler), for graphstep eager,
graphstep captured and torch's AdamW(fused=True) with clip_grad_norm_. The timers and pipelines are
graphstep/app/bench_core.py's.

    python perf/bench_capture.py [--tensors 1000] [--numel 4096] [--steps 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's graphstep, not an installed one
from graphstep.app import bench_core as core  # noqa: E402
from graphstep.app import bench_shapes  # noqa: E402
from graphstep.app import bench_stats  # noqa: E402

PIPELINES = {
    "graphstep eager": lambda inputs: core.build_graphstep(inputs, capture="eager"),
    "graphstep captured": lambda inputs: core.build_graphstep(inputs, capture="graph"),
    "torch AdamW(fused) + clip_grad_norm_": lambda inputs: core.build_torch_adamw(inputs, fused=True, clip=True),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    device = core.pick_device(args.device)
    inputs = core.Inputs(bench_shapes.many_tensors(args.tensors, args.numel), device)
    rows = {}
    for name, build in PIPELINES.items():
        pipeline = build(inputs)
        times = core.time_steps(pipeline.step, device, args.warmup, args.steps, before=pipeline.refill)
        ops, note = core.count_ops(pipeline)
        rows[name] = {**bench_stats.summarize(times), "ops_per_step": ops, "notes": "; ".join(filter(None, [pipeline.notes, note]))}
        pipeline = None
        core.free_memory(device)
    base = rows["graphstep captured"]["median_ms"]
    print(f"device: {core.device_name(device)}, {args.tensors} tensors x {inputs.numel // args.tensors} elements\n")
    print("| pipeline | ms/step (median) | p10 | p90 | × captured | ops/step |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} | {r['p90_ms']:.2f} | "
              f"{r['median_ms'] / base:.2f} | {r['ops_per_step']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "tensors": args.tensors, "numel": args.numel,
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
