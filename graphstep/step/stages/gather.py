"""All-gather the updated param shards bucket by bucket, so every rank holds every current param.

In place and allocation-free: each bucket's output is ``param_flat[bucket]`` and its input is this
rank's slice of that same range (where the copy-back has just written the updated shard), which gloo and
NCCL both accept. Buckets go last-to-first: the last bucket holds the first layers of the forward (the
layout orders buckets by backward), so with ``overlap_param_gather`` the params the next forward needs
first arrive first.

With ``overlap_param_gather`` (and overlap enabled, i.e. not under a capture) the all-gathers are only
launched here; forward pre-hooks of the next iteration wait on each bucket just before a module uses its
params (graphstep.hooks.grad_overlap), and the next step's reduce stage waits on any still pending.
"""

from . import Stage


def bucket_gathers(ctx) -> list[tuple[int, object, object, str]]:
    """(bucket, whole, mine, what) per bucket, in launch order (last bucket first)."""
    layout, buffers, rank = ctx.layout, ctx.buffers, ctx.rank
    gathers = []
    for bucket in reversed(layout.buckets):
        lo, hi = bucket.shard_range(rank)
        flat = buffers.param_flat[bucket.buffer]
        gathers.append((bucket.index, flat[bucket.start:bucket.end], flat[lo:hi],
                        f"param all-gather of bucket {bucket.index} (of {len(layout.buckets)})"))
    return gathers


def build(ctx, *, deferrable: bool = True) -> Stage:
    """``deferrable=False`` always gathers before returning (e.g. after loading a checkpoint)."""
    comm = ctx.comm
    gathers = bucket_gathers(ctx)

    def apply() -> None:
        defer = deferrable and comm.overlap_enabled and comm.defer_param_gather
        for bucket, whole, mine, what in gathers:
            comm.all_gather(whole, mine, what, key=("gather", bucket) if defer else None)

    return Stage("gather", apply)
