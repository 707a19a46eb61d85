"""Distributed optimizer benchmark: graphstep vs ZeroRedundancyOptimizer(AdamW fused) vs DDP + AdamW fused.

    python perf/bench_distributed.py                 # 2 and 4 gloo ranks on 127.0.0.1, prints a table
    python perf/bench_distributed.py --world-sizes 2 --width 1024 --layers 8 --iters 20

Every variant trains the same MLP (``--layers`` x Linear(width, width) + GELU) with AdamW on the same
per-rank batches, one process per rank, one thread each:

- graphstep: ``use_distributed_optimizer=True``; backward accumulates into the flat grad buffer, the step
  reduce-scatters it bucket by bucket in place, updates this rank's shard of the fp32 params in place
  (they are the main params), all-gathers the params.
- ZeRO-1: DDP (grad all-reduce during backward) + ``torch.distributed.optim.ZeroRedundancyOptimizer``
  wrapping ``AdamW(fused=True)`` (each rank steps its partition, then the params are broadcast).
- DDP: DDP + ``AdamW(fused=True)`` on every rank.

Columns: ``iter ms`` = forward + backward + step (DDP communicates inside backward, so only whole
iterations compare fairly); ``step ms`` = ``opt.step()`` alone (with overlap, what is left of the
communication after backward); ``comm MB/step/rank`` = bytes each rank sends per iteration, computed from
the collectives' sizes with the ring formulas (all-reduce 2(n-1)/n x size, reduce-scatter and all-gather
(n-1)/n x size, a broadcast of a partition sends it to n-1 peers from its owner, averaged per rank);
``optimizer MB/rank`` = the per-element optimizer memory of the most loaded rank, measured: graphstep's
``opt.memory_stats()`` (main params apart from the params, every state, communication and cast scratch;
its few step scalars aside), torch's ``optimizer.state`` tensors of more than one element (its 0-d step
counters aside); ``ZeRO formula MB`` = what ZeRO's accounting says that memory is (fp32 AdamW over N
ranks: 8P/N bytes; replicated: 8P). Medians over ``--iters`` after ``--warmup``. Never imported by the
library or the tests.

The layer-wise Muon row trains the same MLP with ``optimizer="muon"``: each rank owns whole matrices
(graphstep.plan.layerwise) and keeps their momentum (4 B per element), the biases go to Adam (8 B per element);
its formula is those bytes over N ranks. Its optimizer MB is again the most loaded rank's: with matrices
of one shape the split is even.

Adding a row: write ``run_<name>(rank, world, args, data) -> Row`` and register it in ``VARIANTS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pickle
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from graphstep.app.demo_dist import free_port  # noqa: E402


@dataclass(frozen=True)
class Row:
    """One variant on one rank."""

    iter_ms: float
    step_ms: float
    sent_bytes: float  # per rank per iteration
    optimizer_bytes: int  # measured on this rank
    formula_bytes: float  # ZeRO's accounting for the same memory


def zero_formula_bytes(numel: int, world: int, bytes_per_element: int, sharded: bool = True) -> float:
    """ZeRO's per-rank optimizer memory (Rajbhandari et al. 2020, §3): the per-element optimizer bytes
    (fp32 AdamW: 8 for the moments, plus 4 of fp32 main params for half params) over ``world`` ranks."""
    return numel * bytes_per_element / (world if sharded else 1)


def make_model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks)


def batches(rank: int, width: int, batch: int, count: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(batch, width, generator=g) for _ in range(count)]


def _time_loop(model, opt, data, warmup: int):
    iter_ms, step_ms = [], []
    import torch.distributed as dist

    for i, x in enumerate(data):
        dist.barrier()
        start = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        before_step = time.perf_counter()
        opt.step()
        opt.zero_grad()
        end = time.perf_counter()
        if i >= warmup:
            iter_ms.append((end - start) * 1e3)
            step_ms.append((end - before_step) * 1e3)
    return statistics.median(iter_ms), statistics.median(step_ms)


def _state_bytes(optimizer) -> int:
    """Bytes of torch's per-param optimizer state, its 0-d step counters aside (graphstep's step scalars
    are left out of its count alike)."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def run_graphstep(rank, world, args, data, overlap=False, optimizer="adam") -> Row:
    from graphstep.config import OptimizerConfig
    from graphstep import get_optimizer

    model = make_model(args.width, args.layers)
    config = OptimizerConfig(optimizer=optimizer, lr=1e-3, weight_decay=0.1, clip_grad=1.0, capture="eager",
                             use_distributed_optimizer=True, bucket_size=args.bucket_size,
                             overlap_grad_reduce=overlap, overlap_param_gather=overlap)
    opt = get_optimizer(config, model)
    iter_ms, step_ms = _time_loop(model, opt, data, args.warmup)
    opt.finish_param_gather()
    n = world
    sent = 0
    for bucket in opt.layout.buckets:
        grad_bytes = opt.buffers.grad_flat[bucket.buffer].element_size()
        param_bytes = opt.buffers.param_flat[bucket.buffer].element_size()
        sent += (n - 1) / n * bucket.numel * (grad_bytes + param_bytes)  # reduce-scatter + all-gather
    sent += 2 * (n - 1) / n * 4  # the grad-norm all-reduce (one fp32)
    device = opt.memory_stats()["device"]
    optimizer_bytes = device["total"] - sum(device.get(kind, 0) for kind in ("params", "grads", "scalars",
                                                                            "graph_pool"))
    if optimizer == "muon":  # momentum of the matrices, Adam's two moments for the biases
        matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
        formula = zero_formula_bytes(matrices, world, 4) + zero_formula_bytes(_numel(model) - matrices, world, 8)
    else:
        formula = zero_formula_bytes(_numel(model), world, 8)
    return Row(iter_ms, step_ms, sent, optimizer_bytes, formula)


def _ddp(model):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=25)


def _ddp_bytes(model, world) -> float:
    return 2 * (world - 1) / world * _numel(model) * 4  # ring all-reduce of fp32 grads


def run_zero(rank, world, args, data) -> Row:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = make_model(args.width, args.layers)
    ddp = _ddp(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3,
                                  weight_decay=0.1, fused=True)
    iter_ms, step_ms = _time_loop(ddp, opt, data, args.warmup)
    # Each rank broadcasts its partition to the n-1 others after its step: averaged, (n-1)/n x size.
    sent = _ddp_bytes(model, world) + (world - 1) / world * _numel(model) * 4
    return Row(iter_ms, step_ms, sent, _state_bytes(opt.optim), zero_formula_bytes(_numel(model), world, 8))


def run_ddp(rank, world, args, data) -> Row:
    model = make_model(args.width, args.layers)
    ddp = _ddp(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    iter_ms, step_ms = _time_loop(ddp, opt, data, args.warmup)
    return Row(iter_ms, step_ms, _ddp_bytes(model, world), _state_bytes(opt),
               zero_formula_bytes(_numel(model), world, 8, sharded=False))


# name -> run(rank, world, args, data) -> Row, in table order.
VARIANTS = {"graphstep (distributed optimizer)": run_graphstep,
            "graphstep + overlap_grad_reduce/param_gather": lambda *a: run_graphstep(*a, overlap=True),
            "graphstep Muon (layer-wise sharding)": lambda *a: run_graphstep(*a, optimizer="muon"),
            "ZeroRedundancyOptimizer(AdamW fused) + DDP": run_zero,
            "DDP + AdamW(fused)": run_ddp}


def _worker(rank, world, port, outdir, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    data = batches(rank, args.width, args.batch, args.warmup + args.iters)
    results = {}
    for name, fn in VARIANTS.items():
        dist.barrier()
        results[name] = fn(rank, world, args, data)
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump({name: dataclasses.asdict(row) for name, row in results.items()}, f)
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, args) -> dict[str, Row]:
    """Per variant, rank 0's times and bytes sent, with the optimizer memory of the most loaded rank."""
    port = free_port()
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_worker, args=(world, port, outdir, args), nprocs=world, start_method="spawn")
        ranks = []
        for rank in range(world):
            with open(os.path.join(outdir, f"rank{rank}.pkl"), "rb") as f:
                ranks.append(pickle.load(f))
    return {name: Row(**{**row, "optimizer_bytes": max(r[name]["optimizer_bytes"] for r in ranks)})
            for name, row in ranks[0].items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--bucket-size", type=int, default=1_000_000)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)

    numel = sum(p.numel() for p in make_model(args.width, args.layers).parameters())
    print(f"MLP {args.layers} x Linear({args.width}, {args.width}): {numel / 1e6:.2f}M params, fp32, AdamW, "
          f"batch {args.batch} per rank, gloo on 127.0.0.1, 1 thread per rank, torch {torch.__version__}\n")
    print("| ranks | variant | iter ms | step ms | comm MB/step/rank | optimizer MB/rank | ZeRO formula MB |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for world in args.world_sizes:
        for name, row in run(world, args).items():
            print(f"| {world} | {name} | {row.iter_ms:.1f} | {row.step_ms:.1f} | {row.sent_bytes / 1e6:.2f} | "
                  f"{row.optimizer_bytes / 1e6:.4f} | {row.formula_bytes / 1e6:.4f} |")


if __name__ == "__main__":
    main()
