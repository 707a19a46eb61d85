"""Checkpoint benchmark: graphstep.checkpoint save and load time, and bytes on disk per param.

    python perf/bench_checkpoint.py                       # GPT-2 small shapes, 1 and 2 gloo ranks
    python perf/bench_checkpoint.py --shapes gpt2-quick   # ~10M params, seconds

The model is a bag of params with the shapes of ``graphstep.app.bench_shapes`` (fp32, Adam: each param saves its fp32
main param, exp_avg and exp_avg_sq, so 12 bytes per param plus DCP's metadata; the model's own state dict
is not included). Save = ``gs.checkpoint.save`` (DCP write, fsync, atomic directory swap); load =
``gs.checkpoint.load`` (safe metadata read, validation, copy into the static buffers, publish). With 2
ranks the times are the slowest rank's, between barriers. One run each: the figures are one sample on
this machine's disk, not a median. Never imported by the library or the tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from graphstep.app import bench_shapes as shape_sets  # noqa: E402
from graphstep.app.demo_dist import free_port  # noqa: E402


class Bag(torch.nn.Module):
    """Params with the given names (dots become underscores) and shapes, small random values."""

    def __init__(self, shapes):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = torch.nn.ParameterDict({name.replace(".", "_"): torch.nn.Parameter(
            torch.randn(shape, generator=g) * 0.02) for name, shape in shapes})


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run(rank: int, world_size: int, shapes_name: str, path: str, port: int, out: str) -> None:
    import graphstep as gs
    import torch.distributed as dist

    torch.set_num_threads(1 if world_size > 1 else 2)
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=300))
    barrier = dist.barrier if world_size > 1 else (lambda: None)
    model = Bag(shape_sets.SETS[shapes_name]())
    opt = gs.get_optimizer(gs.OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=world_size > 1,
                                              capture="eager"), model)
    numel = sum(p.numel() for p in model.parameters())
    barrier()
    t0 = time.perf_counter()
    gs.checkpoint.save(opt, path)
    barrier()
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gs.checkpoint.load(opt, path)
    barrier()
    load_s = time.perf_counter() - t0
    if rank == 0:
        size = disk_bytes(path)
        with open(out, "w") as f:
            json.dump({"ranks": world_size, "params": numel, "save_s": save_s, "load_s": load_s,
                       "bytes": size, "bytes_per_param": size / numel}, f)


def measure(world_size: int, shapes_name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        path = os.path.join(tmp, "ckpt")
        if world_size == 1:
            run(0, 1, shapes_name, path, 0, out)
        else:
            port = free_port()
            mp.start_processes(run, args=(world_size, shapes_name, path, port, out), nprocs=world_size,
                               start_method="spawn")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="gpt2-small", choices=sorted(shape_sets.SETS))
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = [measure(int(n), args.shapes) for n in args.world_sizes.split(",")]
    print(f"{args.shapes}: {rows[0]['params']:,} params, fp32 Adam (main param + 2 states)")
    print("| ranks | save s | load s | MB on disk | bytes/param |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['ranks']} | {r['save_s']:.2f} | {r['load_s']:.2f} | {r['bytes'] / 1e6:.0f} | "
              f"{r['bytes_per_param']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
