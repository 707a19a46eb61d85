"""Data-parallel training with graphstep's distributed optimizer, launched by torchrun (CPU + gloo works).

    torchrun --nproc_per_node 2 perf/train_ddp.py                 # 2 ranks on this machine, gloo
    torchrun --nproc_per_node 4 perf/train_ddp.py --steps 100 --overlap
    torchrun --nproc_per_node 8 perf/train_ddp.py --backend nccl  # one GPU per rank

Each rank trains the same built-in GPT (graphstep.app.models.tiny) on its slice of every global batch;
graphstep reduce-scatters the grads bucket by bucket, updates this rank's shard of the fp32 main params
and Adam state, and all-gathers the new params, so every rank ends every step with the same model. Rank 0
prints the loss and grad norm (the only host syncs, marked) and, at the end, checks that all ranks hold
bitwise-identical params.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from graphstep.app import models  # noqa: E402
from graphstep.config import OptimizerConfig  # noqa: E402
from graphstep import get_optimizer  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--overlap", action="store_true", help="overlap_grad_reduce + overlap_param_gather")
    parser.add_argument("--capture", default="eager", choices=["eager", "graph", "auto"])
    parser.add_argument("--timeout", type=float, default=60.0, help="distributed_timeout_s")
    args = parser.parse_args(argv)

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else "cpu"
    if args.backend == "nccl":
        # Before the group exists: NCCL's communicator, the capture's side stream and every kernel of this
        # rank must land on this rank's GPU, not on GPU 0.
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of the {world} ranks")

    cfg = models.tiny()
    model = models.GPT(cfg, seed=0).to(device)  # same seed: every rank starts from the same params
    corpus = models.SyntheticCorpus(cfg.vocab_size, seed=0)
    config = OptimizerConfig(optimizer="adam", lr=3e-3, weight_decay=0.1, adam_beta2=0.95, clip_grad=1.0,
                             use_distributed_optimizer=True, overlap_grad_reduce=args.overlap,
                             overlap_param_gather=args.overlap, capture=args.capture,
                             distributed_timeout_s=args.timeout)
    opt = get_optimizer(config, model)  # process_group=None: WORLD is the data-parallel group
    per_rank = args.global_batch // world

    start = time.perf_counter()
    for step in range(args.steps):
        inputs, targets = corpus.batch(step, args.global_batch, cfg.seq_len, device=device)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)  # this rank's slice of the global batch
        loss = model(inputs[rows], targets[rows])
        opt.scale_loss(loss).backward()
        result = opt.step()  # reduce-scatter, norm, clip, sharded update, all-gather: no host sync
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            # sync point: reading the loss and the norm on the host
            print(f"step {step:4d}  loss {loss.item():.4f}  grad_norm {result.grad_norm.item():.4f}  "
                  f"ok {bool(result.update_successful.item())}", flush=True)
    elapsed = time.perf_counter() - start

    # overlap_param_gather leaves the last step's all-gathers in flight until the next forward: finish them
    # before reading params outside a forward (a checkpoint save needs the same).
    opt.finish_param_gather()
    # Every rank must hold the same params: compare a checksum across ranks (a sync, after training).
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    checksum = torch.stack([flat.sum(), (flat * torch.arange(flat.numel(), dtype=torch.float64,
                                                            device=flat.device)).sum()])
    gathered = [torch.zeros_like(checksum) for _ in range(world)]
    dist.all_gather(gathered, checksum)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    if rank == 0:
        print(f"{world} ranks x {per_rank} sequences, {args.steps} steps in {elapsed:.1f} s "
              f"({elapsed / args.steps * 1e3:.0f} ms/step); params identical on all ranks: {same}")
    dist.barrier()
    # The captured step goes before the communicators it captured: NCCL waits, in destroy, for every graph
    # holding them (graphstep also does this inside destroy_process_group; closing says it in the code).
    opt.close()
    dist.destroy_process_group()
    if not same:
        raise SystemExit("params differ between ranks")


if __name__ == "__main__":
    main()
