"""Captured versus eager: the engine's full step on many small tensors, side by side in one process.

On a GPU the captured step is one graph launch against dozens of kernel launches eagerly; on the CPU
the replay backend skips Python but not the kernels. Reports ms/step (median, p10, p90) and the ops
dispatched per step (counted with a dispatch mode: a proxy for kernel launches), for graphstep eager,
graphstep captured and torch's AdamW(fused=True) with clip_grad_norm_.

    python perf/bench_capture.py [--tensors 1000] [--numel 4096] [--steps 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import graphstep as gs


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class ManyTensors(torch.nn.Module):
    def __init__(self, tensors: int, numel: int, device):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(numel, device=device) * 0.02)
                                              for _ in range(tensors))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step, device, steps):
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return {"median_ms": statistics.median(times), "p10_ms": times[len(times) // 10],
            "p90_ms": times[(9 * len(times)) // 10]}


def count_ops(step):
    counter = OpCounter()
    with counter:
        step()
    return counter.count


def fill_grads(params, seed=0):
    g = torch.Generator(device=params[0].device).manual_seed(seed)
    for p in params:
        grad = p.main_grad if hasattr(p, "main_grad") else p.grad
        grad.copy_(torch.randn(p.shape, generator=g, device=p.device) * 1e-3)


def bench_graphstep(mode, args, device):
    model = ManyTensors(args.tensors, args.numel, device)
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0, capture=mode,
                                              capture_warmup_steps=2), model)
    params = list(model.parameters())
    fill_grads(params)
    for _ in range(4):  # warm-up and, for "graph", the capture
        opt.step()
    assert mode != "graph" or opt.captured
    return {**time_steps(opt.step, device, args.steps), "ops_per_step": count_ops(opt.step)}


def bench_torch(args, device):
    model = ManyTensors(args.tensors, args.numel, device)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    fill_grads(params)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    for _ in range(3):
        step()
    return {**time_steps(step, device, args.steps), "ops_per_step": count_ops(step)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = {
        "graphstep eager": bench_graphstep("eager", args, device),
        "graphstep captured": bench_graphstep("graph", args, device),
        "torch AdamW(fused) + clip_grad_norm_": bench_torch(args, device),
    }
    base = rows["graphstep captured"]["median_ms"]
    print(f"device: {device}, {args.tensors} tensors x {args.numel} elements\n")
    print("| pipeline | ms/step (median) | p10 | p90 | × captured | ops/step |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} | {r['p90_ms']:.2f} | "
              f"{r['median_ms'] / base:.2f} | {r['ops_per_step']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "tensors": args.tensors, "numel": args.numel, "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
