"""All-gather the updated param shards bucket by bucket, so every rank holds every current param."""

import torch.distributed as dist

from . import Stage


def build(ctx) -> Stage:
    layout, buffers, comm, rank = ctx.layout, ctx.buffers, ctx.comm, ctx.rank
    pairs = []
    for bucket in layout.buckets:
        lo, hi = bucket.shard_range(rank)
        flat = buffers.param_flat[bucket.buffer]
        pairs.append((flat[bucket.start:bucket.end], flat[lo:hi]))

    def apply() -> None:
        for whole, mine in pairs:
            dist.all_gather_into_tensor(whole, mine.clone(), group=comm.dp_group)

    return Stage("gather", apply)
