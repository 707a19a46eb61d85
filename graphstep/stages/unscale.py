"""Non-finite check and global grad norm in one read of the (still loss-scaled) grads.

No pass unscales the grads: the norm of the scaled grads times 1/scale is the norm of the unscaled ones,
and the unscale itself is folded into the update's grad scale (stages/clip.py). A non-finite grad makes
the sum of squares non-finite, which is the inf check; summing the squares across ranks (SUM all-reduce)
carries a non-finite value to every rank, so all ranks decide the skip alike from the same number.
"""

import torch

from . import Stage


# Row length of the two-level sum of squares. A single reduction over a whole buffer accumulates in fp32
# over millions of elements: at 124M grads (GPT-2 small) torch.dot and vector_norm were off by 0.3% and
# 2% against an fp64 sum. Norms of 4,096-element rows, then the sum of their squares, came within 3e-8
# and ran as fast as dot (12.8 against 13.6 ms, side by side on the 2-core CPU).
ROW = 4096
MIN_ROW = 64


def row_length(numel: int) -> int:
    """The largest power of two <= ROW dividing ``numel`` (buckets are padded to multiples of 128, so
    usually no tail is left, and the step has the same ops at any size), or ROW with a tail."""
    row = ROW
    while row > MIN_ROW and numel % row:
        row //= 2
    return row if numel % row == 0 else ROW


class SumOfSquares:
    """fp32 sum of squares of one flat grad buffer: one read, no copy, accurate at any length."""

    def __init__(self, grad: torch.Tensor):
        n = grad.numel()
        row = row_length(n)
        body = n - n % row
        self.rows = grad[:body].view(-1, row)
        self.tail = grad[body:]
        self.row_norms = torch.empty(self.rows.shape[0], dtype=torch.float32, device=grad.device)

    def __call__(self) -> torch.Tensor:
        torch.linalg.vector_norm(self.rows, dim=1, dtype=torch.float32, out=self.row_norms)
        total = self.row_norms.square().sum()
        if self.tail.numel():
            total = total + torch.linalg.vector_norm(self.tail, dtype=torch.float32).square()
        return total


def build(ctx) -> Stage:
    grads = ctx.buffers.grad_shard
    t = ctx.tensors
    comm = ctx.comm

    sums = [SumOfSquares(g) for g in grads]

    def apply() -> None:
        parts = [sum_of_squares() for sum_of_squares in sums]
        sumsq = parts[0] if len(parts) == 1 else torch.stack(parts).sum()
        comm.all_reduce_sum(sumsq, "grad-norm all_reduce")
        norm = sumsq.sqrt()
        t.found_inf.copy_(torch.logical_not(torch.isfinite(norm)))
        t.grad_norm.copy_(norm * t.inv_loss_scale)

    return Stage("unscale", apply)
