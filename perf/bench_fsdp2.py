"""graphstep against torch's ``clip_grad_norm_`` + ``AdamW(fused=True)`` as the optimizer step of the same FSDP2
(``fully_shard``) model on 2 gloo ranks: ms and aten ops per step at 150 and 10,000 params of 16 x 16, timed in
interleaved rounds (one step of each per round; the grads of one backward, kept), with the ratio's 95% bootstrap
interval, and the first step of each, timed apart (torch's fills DTensor's dispatch caches: minutes at 10,000
params on this CPU). Both clip at 1.0 and update every param; graphstep runs its default (eager on a CPU,
captured where the device has CUDA graphs).

    python perf/bench_fsdp2.py [--rounds 60] [--counts 150,10000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's graphstep, not an installed one
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import graphstep as gs  # noqa: E402
from capture.profile import OpCounter  # noqa: E402
from graphstep.app import bench_core as core  # noqa: E402
from graphstep.app.demo_dist import free_port  # noqa: E402
from graphstep.app.bench_stats import ratio_interval  # noqa: E402

SHAPE = (16, 16)
WORLD = 2


class Params(torch.nn.Module):
    def __init__(self, count: int):
        super().__init__()
        torch.manual_seed(0)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(SHAPE)) for _ in range(count)])

    def forward(self):
        return sum(w.square().sum() for w in self.weights)


def _sharded(count: int):
    from torch.distributed.fsdp import fully_shard
    model = Params(count)
    fully_shard(model)
    return model


def _steps(count: int) -> dict:
    ours, theirs = _sharded(count), _sharded(count)
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0), ours, config_overrides={})
    reference = torch.optim.AdamW(theirs.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    for model in (ours, theirs):
        model().backward()  # one backward each, after the build: the grads every timed step reads

    def torch_step():
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
        reference.step()

    return {"graphstep": opt.step, "torch": torch_step}


def _count_ops(step) -> int:
    counter = OpCounter()
    with counter:
        step()
    return counter.count


def _rank(rank: int, port: int, counts: list[int], rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    rows = []
    for count in counts:
        steps = _steps(count)
        first = {}
        for key, step in steps.items():  # the first step of each: its build-time caches (torch: DTensor dispatch)
            start = time.perf_counter()
            step()
            first[key] = time.perf_counter() - start
        ops = {key: _count_ops(step) for key, step in steps.items()}
        times = core.time_interleaved(steps, torch.device("cpu"), warmup=5, rounds=rounds)
        ratio, low, high = ratio_interval(times["graphstep"], times["torch"])
        rows.append({"params": count, "ops": ops, "ms": {k: statistics.median(v) for k, v in times.items()},
                     "ratio": ratio, "interval": [low, high], "first_step_s": first})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--counts", default="150,10000")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(_rank, args=(port, [int(c) for c in args.counts.split(",")], args.rounds, out),
                           nprocs=WORLD, start_method="spawn")
        rows = json.loads(Path(out).read_text())
    print(f"torch {torch.__version__}, {WORLD} gloo ranks, 1 thread each, {args.rounds} interleaved rounds, "
          f"params of {SHAPE[0]} x {SHAPE[1]} sharded by fully_shard")
    print("| params | graphstep ms/step | torch clip_grad_norm_ + AdamW(fused) ms/step | ratio (95% interval) | "
          "graphstep ops/step | torch ops/step | first step, graphstep / torch (s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        low, high = row["interval"]
        first = row["first_step_s"]
        print(f"| {row['params']:,} | {row['ms']['graphstep']:.2f} | {row['ms']['torch']:.2f} | "
              f"{row['ratio']:.3f} ({low:.3f}–{high:.3f}) | {row['ops']['graphstep']} | {row['ops']['torch']} | "
              f"{first['graphstep']:.2f} / {first['torch']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
