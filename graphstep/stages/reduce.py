"""Reduce-scatter the grads bucket by bucket: each rank receives the averaged grads of its shard.

Per bucket, ``grad_flat[bucket]`` (every rank's full local grads) is reduce-scattered into
``grad_shard[bucket.shard_offset : + shard_numel]`` (this rank's piece, averaged over the data-parallel
ranks). The layout pads every bucket to a multiple of lcm(dp, 128), so the split is even (gloo has no
uneven reduce-scatter) and the padding stays zero.

Averaging: ``avg`` where the backend supports it (gloo in current torch and NCCL: SUM, then one divide of
the received shard); otherwise, and always for fp16 grads (a SUM could overflow fp16's range where the
mean does not), a pre-scale of the bucket by 1/dp and a SUM. See distributed.py.

With ``overlap_grad_reduce`` a bucket's reduce-scatter may already be in flight, launched by a
post-accumulate-grad hook the moment its last grad arrived (graphstep.overlap); the stage then only waits
on it. The choice is host state (whether a launch is pending), never device data; under a capture the
hooks are off, so the recorded step always holds the collectives themselves.

Build time (this stage's init): every data-parallel rank checks that all ranks planned the same layout
with the same config (``Collectives.setup``), before any step pairs up buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import Stage


@dataclass(frozen=True)
class BucketReduce:
    """One bucket's reduce-scatter: what it reads, where it writes, how it averages."""

    bucket: int
    params: tuple[int, ...]  # param indices of the bucket (what the overlap hooks count)
    grads: torch.Tensor  # grad_flat[bucket.start:bucket.end]
    shard: torch.Tensor  # this rank's piece, in grad_shard
    op: str  # "avg" or "sum"
    prescale: float  # 1/dp when op == "sum", else 1.0
    what: str

    @property
    def overlappable(self) -> bool:
        """Whether a backward hook may launch it early: not when it pre-scales the grads in place (fp16),
        since a later backward (grad accumulation) would add unscaled grads to pre-scaled ones."""
        return self.prescale == 1.0

    def launch(self, comm, *, key=None) -> None:
        if self.prescale != 1.0:
            self.grads.mul_(self.prescale)
        comm.reduce_scatter(self.shard, self.grads, self.what, op=self.op, key=key)


def bucket_reduces(ctx) -> list[BucketReduce]:
    """The reduce-scatter of every bucket, in bucket (= backward) order. Probes the backend once."""
    layout, buffers, comm = ctx.layout, ctx.buffers, ctx.comm
    dtypes = {buffers.grad_flat[b.buffer].dtype for b in layout.buckets}
    can_average = {dtype: dtype != torch.float16 and comm.supports_average(dtype) for dtype in dtypes}
    reduces = []
    for bucket in layout.buckets:
        grads = buffers.grad_flat[bucket.buffer][bucket.start:bucket.end]
        shard = buffers.grad_shard[bucket.buffer][bucket.shard_offset:bucket.shard_offset + bucket.shard_numel]
        average = can_average[grads.dtype]
        reduces.append(BucketReduce(bucket.index, bucket.params, grads, shard, "avg" if average else "sum",
                                    1.0 if average else 1.0 / layout.dp_size,
                                    f"grad reduce-scatter of bucket {bucket.index} (of {len(layout.buckets)})"))
    return reduces


def build(ctx) -> Stage:
    comm = ctx.comm
    comm.setup(ctx.layout, ctx.config)
    reduces = bucket_reduces(ctx)

    def apply() -> None:
        # The previous step's deferred all-gathers (overlap_param_gather) read and write param_flat, which
        # this step's copy-back writes: finish them first (none pending without overlap).
        if comm.pending:
            comm.wait_all("gather")
        for reduce in reduces:
            key = ("reduce", reduce.bucket)
            if comm.overlap_enabled and comm.wait(key):
                continue  # launched by the backward hook, now finished
            if key in comm.pending:
                comm.wait(key)  # launched before overlap was switched off: finish it, then run it here
                # (only "avg" buckets are launched from hooks, so running it again is idempotent)
            reduce.launch(comm)

    return Stage("reduce", apply)
