"""Count zero grad elements on device (``log_num_zeros_in_grad``), padding excluded."""

import torch

from . import Stage


def build(ctx, *others) -> Stage:
    """``others``: further domains' contexts (expert params), counted together in one all-reduce."""
    domains = (ctx, *others)
    grads = [g for c in domains for g in c.buffers.grad_shard]
    # Padding elements are always zero (nothing writes them); subtract their known count.
    padding = sum(c.layout.padding_numel(c.rank) for c in domains)
    total = sum(g.numel() for g in grads)
    t = ctx.tensors
    comm = ctx.comm

    def apply() -> None:
        nonzero = torch.stack([torch.count_nonzero(g) for g in grads]).sum()
        zeros = (total - padding) - nonzero
        comm.all_reduce_sum(zeros, "zero-count all_reduce")
        t.num_zeros.copy_(zeros)

    return Stage("zeros", apply)
