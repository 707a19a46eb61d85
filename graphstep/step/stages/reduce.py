"""Reduce-scatter the grads bucket by bucket: each rank receives the averaged grads of its shard.

Per bucket, ``grad_flat[bucket]`` (every rank's full local grads) is reduce-scattered in place: the output
is this rank's own slice of it, ``grad_flat[bucket.shard_range(rank)]`` (``grad_shard[bucket.index]``), the
in-place form gloo and NCCL both accept (on gloo, 2 and 4 ranks, fp32/bf16/fp16, several in flight at
once, it equals a reduce-scatter into a separate output bitwise: tests/distributed/test_memory_stats.py).
No output buffer: ZeRO's grad memory is the grad buffer. The layout pads every bucket to a multiple of
lcm(dp, 128), so the split is even (gloo has no uneven reduce-scatter) and the padding stays zero.

Averaging: a SUM reduce-scatter, then the received shard times 1/dp: a pass over 1/dp of the bucket,
not over all of it (gloo has no PREMUL_SUM; its AVG measured no faster than SUM plus this multiply, and a
backend without AVG needs nothing else). fp16 grads instead are pre-scaled by 1/dp before the SUM (as
Megatron-Core does): a SUM of fp16 grads can overflow fp16's range where their mean would not.

With ``overlap_grad_reduce`` a bucket's reduce-scatter may already be in flight, launched by a
post-accumulate-grad hook the moment its last grad arrived (graphstep.hooks.grad_overlap); the stage then only waits
on it. The choice is host state (whether a launch is pending), never device data; under a capture the
hooks are off (they are only ever switched on once the step is known to run eagerly), so the recorded
step always holds the collectives themselves. A reduce runs once per step: being in place, running it
again would sum the already-summed slice with the other ranks' local grads.

The layout agreement across ranks (``Collectives.setup``) runs once in the engine's build, before any
stage is built; this factory talks to no other rank.
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
    shard: torch.Tensor  # this rank's piece: grad_shard[bucket], a slice of ``grads`` (in place)
    inv_dp: float
    prescale: bool  # fp16: scale the bucket by 1/dp before the SUM; otherwise the received shard after it
    what: str

    @property
    def overlappable(self) -> bool:
        """Whether a backward hook may launch it early: not when it pre-scales the grads in place (fp16),
        since a later backward (grad accumulation) would add unscaled grads to pre-scaled ones."""
        return not self.prescale

    def launch(self, comm, *, key=None) -> None:
        """Start (``key``) or run the SUM reduce-scatter; ``finish`` completes the average."""
        if self.prescale:
            self.grads.mul_(self.inv_dp)
        comm.reduce_scatter(self.shard, self.grads, self.what, op="sum", key=key)

    def finish(self) -> None:
        if not self.prescale:
            self.shard.mul_(self.inv_dp)


def bucket_reduces(ctx) -> list[BucketReduce]:
    """The reduce-scatter of every bucket, in bucket (= backward) order."""
    layout, buffers = ctx.layout, ctx.buffers
    inv_dp = 1.0 / (ctx.average_over or layout.dp_size)  # experts: the full data-parallel size (experts.py)
    reduces = []
    for bucket in layout.buckets:
        grads = buffers.grad_flat[bucket.buffer][bucket.start:bucket.end]
        shard = buffers.grad_shard[bucket.index]
        reduces.append(BucketReduce(bucket.index, bucket.params, grads, shard, inv_dp,
                                    grads.dtype == torch.float16,
                                    f"grad reduce-scatter of bucket {bucket.index} (of {len(layout.buckets)})"))
    return reduces


def build(ctx) -> Stage:
    comm, folded = ctx.comm, ctx.folded
    reduces = bucket_reduces(ctx)

    def apply() -> None:
        # The previous step's deferred all-gathers (overlap_param_gather) read and write param_flat, which
        # this step's copy-back writes: finish them first (none pending without overlap).
        if comm.pending:
            comm.wait_all("gather")
        for reduce in reduces:
            # fold_grad_norm with overlap: a backward hook already landed (finished and folded) this bucket.
            if folded is not None and folded.take_landed(reduce.bucket):
                continue
            # Launched by a backward hook (overlap_grad_reduce): finish it. (Overlap may have been switched
            # off since, by close(); a capture never follows a launch: hooks stay off where one may record.)
            if not comm.wait(("reduce", reduce.bucket)):
                reduce.launch(comm)
            reduce.finish()
            if folded is not None:  # its sum of squares while the shard is hot (graphstep.step.folded_sums)
                folded.fold(reduce.bucket)

    return Stage("reduce", apply)


def local_average(ctx) -> Stage:
    """Grads times 1/``average_over``, in place, for a domain that averages without a reduce-scatter: an
    expert domain with an expert data-parallel size of 1 (graphstep/plan/experts.py, rule 1). The grads the user
    reads after the step are then the averaged ones, as with the reduce-scatter's pre-scaled fp16 buckets."""
    grads = list(ctx.buffers.grad_shard)  # the grad buffers themselves when the domain is not sharded
    inv_dp = 1.0 / ctx.average_over
    folded = ctx.folded

    def apply() -> None:
        for unit, grad in enumerate(grads):
            grad.mul_(inv_dp)
            if folded is not None:  # fold_grad_norm: its sum of squares while it is hot
                folded.fold(unit)

    return Stage("average", apply)


def first_stages(ctx) -> list[Stage]:
    """A domain's first stage: its reduce-scatter when it is sharded; otherwise the local average when its
    grads must still be averaged (``ctx.average_over``); otherwise none (one rank: nothing to average)."""
    if ctx.layout.dp_size > 1:
        return [build(ctx)]
    return [local_average(ctx)] if ctx.average_over else []
