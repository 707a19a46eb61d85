"""What the spawned ranks of the folded-norm tests run (tests/distributed/test_folded_norm_sharded.py).

Every variant trains the toy with the distributed optimizer, clipping active, over 1-4 micro-batches per
step (earlier ones under ``no_sync()``), with an inf injected into one micro-batch of one step on one rank.
"""

from __future__ import annotations

import math

from graphstep.config import OptimizerConfig
from graphstep import get_optimizer
from _harness import local_loss, tiny_transformer

STEPS = 6
INF_STEP = 3
CLIP = 0.5
BUCKET = 3000  # several buckets, so that overlap launches (and lands) several per backward
SGD = dict(optimizer="sgd", lr=0.05, weight_decay=1e-3, sgd_momentum=0.9)
OVERLAP = dict(overlap_grad_reduce=True)
BOTH_OVERLAPS = dict(overlap_grad_reduce=True, overlap_param_gather=True)


def config(world_size: int, **changes) -> OptimizerConfig:
    fields = dict(SGD, clip_grad=CLIP, bucket_size=BUCKET, capture="eager", kernel="fused",
                  use_distributed_optimizer=world_size > 1, distributed_timeout_s=20.0)
    fields.update(changes)
    return OptimizerConfig(**fields)


def train(rank: int, world_size: int, micro_batches: int, inf_micro: int, **changes) -> dict:
    """The last rank multiplies micro-batch ``inf_micro`` of step INF_STEP by inf. One rank: the oracle."""
    model = tiny_transformer()
    opt = get_optimizer(config(world_size, **changes), model)
    ok, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(micro_batches):
            loss = local_loss(model, step * micro_batches + micro, rank, world_size) / micro_batches
            if step == INF_STEP and micro == inf_micro and rank == world_size - 1:
                loss = loss * math.inf
            if micro < micro_batches - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        result = opt.step()
        ok.append(bool(result.update_successful.item()))
        norms.append(float(result.grad_norm.item()))
    opt.finish_param_gather()
    return {"params": [p.detach().clone() for p in model.parameters()], "ok": ok, "norms": norms,
            "folds": dict(opt.fold_counts), "launched": opt.overlap_counts["launched_reduces"],
            "captured": opt.captured}


VARIANTS = {
    "plain": {},
    "fold": dict(fold_grad_norm=True),
    "fold_overlap": dict(fold_grad_norm=True, **OVERLAP),
    "fold_both_overlaps": dict(fold_grad_norm=True, **BOTH_OVERLAPS),
    # CPU offload of half of each rank's shard: the norm still folds over the device grads of the whole shard.
    "fold_offload": dict(fold_grad_norm=True, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5),
}


def folded(rank: int, world_size: int) -> dict:
    """Every variant at 1-4 micro-batches (the inf in a different micro-batch each time), then the folded
    step captured (replay backend) against eager. One spawn for all: starting ranks costs more than these."""
    out = {}
    for micro_batches in (1, 2, 3, 4):
        inf_micro = (micro_batches - 1) // 2
        for name, changes in VARIANTS.items():
            out[(name, micro_batches)] = train(rank, world_size, micro_batches, inf_micro, **changes)
    for mode in ("eager", "graph"):
        out[("capture", mode)] = train(rank, world_size, 2, 1, fold_grad_norm=True, capture=mode,
                                       capture_warmup_steps=2)
    return out
