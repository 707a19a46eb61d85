"""Count zero grad elements on device (``log_num_zeros_in_grad``), padding excluded, each element once across
the model-parallel ranks: buffers of params another rank counts (``BufferLayout.counted_in_norm``) are left
out, as Megatron-Core's ``count_zeros_fp32`` leaves out tensor-parallel copies and shared params."""

import torch

from . import Stage


def build(ctx, *others) -> Stage:
    """``others``: the expert domains' contexts (expert params), counted together in one all-reduce."""
    domains = (ctx, *others)
    grads = [g for c in domains for g, counted in zip(c.buffers.grad_shard, c.layout.shard_entries_counted(),
                                                      strict=True) if counted]
    # Padding elements are always zero (nothing writes them); subtract their known count.
    counted_buffers = [[b for b, buffer in enumerate(c.layout.buffers) if buffer.counted_in_norm] for c in domains]
    padding = sum(c.layout.padding_numel(c.rank, chosen) for c, chosen in zip(domains, counted_buffers))
    total = sum(g.numel() for g in grads)
    t = ctx.tensors
    comm = ctx.comm

    def apply() -> None:
        nonzero = (torch.stack([torch.count_nonzero(g) for g in grads]).sum() if grads
                   else torch.zeros((), dtype=torch.int64, device=t.num_zeros.device))
        zeros = (total - padding) - nonzero
        comm.all_reduce_sum(zeros, "zero-count all_reduce")
        t.num_zeros.copy_(zeros)

    return Stage("zeros", apply)
