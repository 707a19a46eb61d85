"""Reduce-scatter the grads bucket by bucket: each rank receives the averaged grads of its shard.

In place: each bucket of ``grad_flat`` is reduce-scattered into this rank's own slice of it, so ZeRO's grad
memory is the grad buffer; the layout pads buckets to an even split (gloo has no uneven reduce-scatter).
Averaging is a SUM, then the received shard times 1/dp (gloo has no PREMUL_SUM, its AVG is no faster, and a backend
without AVG needs nothing else); fp16 grads are pre-scaled by 1/dp before the SUM instead, as Megatron-Core does, since their SUM
can overflow where the mean would not. With ``overlap_grad_reduce`` a bucket's reduce-scatter may already be in
flight (graphstep.hooks.grad_overlap) and the stage only waits on it: a host choice, and the hooks are off under
a capture, so a recorded step always holds the collectives. A reduce runs once per step: being in place, a
second would sum an already-summed slice.
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
