"""The grad-norm pass: accurate at the sizes real models have, and the same op count at any size."""

import pytest
import torch

from graphstep.stages.unscale import ROW, SumOfSquares, row_length


@pytest.mark.parametrize("numel", [0, 7, 128, ROW, 3 * ROW + 5, (1 << 24) + 123, (1 << 24) + 128])
def test_sum_of_squares_matches_fp64(numel):
    # Positive-mean grads are the hard case for an fp32 running sum (every term adds the same sign).
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 1e-3 + 1e-3
    exact = grad.double().square().sum()
    ours = SumOfSquares(grad)()
    assert ours.dtype == torch.float32
    assert abs(ours.double() - exact) <= 1e-6 * exact + 1e-30


def test_sum_of_squares_carries_inf_and_nan():
    grad = torch.ones(5 * ROW + 3)
    total = SumOfSquares(grad)
    grad[ROW + 1] = float("inf")
    assert torch.isinf(total())
    grad[-1] = float("nan")  # in the tail
    assert torch.isnan(total())


def test_rows_divide_buffers_padded_to_128_so_no_tail_is_left():
    assert row_length(ROW * 10) == ROW and row_length(128 * 3) == 128 and row_length(64 * 3) == 64
    assert row_length(7) == ROW  # no power of two from 64 up divides it: rows of ROW and a tail
    assert SumOfSquares(torch.ones(128 * 1001)).tail.numel() == 0
