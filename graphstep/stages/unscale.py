"""Non-finite check and global grad norm in one read of the (still loss-scaled) grads.

No pass unscales the grads: the norm of the scaled grads times 1/scale is the norm of the unscaled ones,
and the unscale itself is folded into the update's grad scale (stages/clip.py). A non-finite grad makes
the sum of squares non-finite, which is the inf check; summing the squares across ranks (SUM all-reduce)
carries a non-finite value to every rank, so all ranks decide the skip alike from the same number.
"""

import torch

from . import Stage


def build(ctx) -> Stage:
    grads = ctx.buffers.grad_shard
    t = ctx.tensors
    comm = ctx.comm

    def apply() -> None:
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        if len(norms) == 1 and not comm.reduces_grad_stats:
            norm = norms[0]
        else:
            sumsq = torch.stack(norms).square().sum()
            comm.all_reduce_sum(sumsq, "grad-norm all_reduce")
            norm = sumsq.sqrt()
        t.found_inf.copy_(torch.logical_not(torch.isfinite(norm)))
        t.grad_norm.copy_(norm * t.inv_loss_scale)

    return Stage("unscale", apply)
