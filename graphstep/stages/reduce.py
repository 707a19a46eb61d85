"""Reduce-scatter the grads bucket by bucket: each rank receives the averaged grads of its shard."""

import torch.distributed as dist

from . import Stage


def build(ctx) -> Stage:
    layout, buffers, comm = ctx.layout, ctx.buffers, ctx.comm
    pairs = []
    for bucket in layout.buckets:
        grads = buffers.grad_flat[bucket.buffer][bucket.start:bucket.end]
        shard = buffers.grad_shard[bucket.buffer][bucket.shard_offset:bucket.shard_offset + bucket.shard_numel]
        pairs.append((grads, shard))
    inv_dp = 1.0 / layout.dp_size

    def apply() -> None:
        for grads, shard in pairs:
            # gloo has no PREMUL_SUM: pre-scale by 1/dp, then SUM.
            grads.mul_(inv_dp)
            dist.reduce_scatter_tensor(shard, grads, group=comm.dp_group)

    return Stage("reduce", apply)
