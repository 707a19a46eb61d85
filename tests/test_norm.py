"""The grad-norm pass: accurate at the sizes real models have, and the same op count at any size."""

import pytest
import torch

from graphstep.step.stages.norm import RESCUE_ROWS, ROW, SumOfSquares


@pytest.mark.parametrize("numel", [0, 7, 128, ROW, 3 * ROW + 5, (1 << 24) + 123, (1 << 24) + 128])
def test_sum_of_squares_matches_fp64(numel):
    # Positive-mean grads are the hard case for an fp32 running sum (every term adds the same sign).
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 1e-3 + 1e-3
    exact = grad.double().square().sum()
    ours = SumOfSquares(grad)()
    assert ours.dtype == torch.float64
    assert abs(ours.double() - exact) <= 1e-6 * exact + 1e-30


def test_sum_of_squares_carries_inf_and_nan():
    grad = torch.ones(5 * ROW + 3)
    total = SumOfSquares(grad)
    grad[ROW + 1] = float("inf")
    assert torch.isinf(total())
    grad[-1] = float("nan")  # in the tail
    assert torch.isnan(total())


def test_rows_are_full_length_and_the_rest_is_a_short_tail():
    # Short rows that divide the buffer exactly cost time (GPT-2 small: 2**8 x an odd number): rows stay
    # ROW long and the rest is summed as a tail.
    numel = 2**8 * 486093  # GPT-2 small's param count
    total = SumOfSquares(torch.ones(numel))
    assert total.rows.shape == (numel // ROW, ROW)
    assert total.tail.numel() == numel % ROW
    assert SumOfSquares(torch.ones(ROW * 10)).tail.numel() == 0
    assert total() == numel


@pytest.mark.parametrize("rows_overflowing", [1, RESCUE_ROWS])
def test_finite_grads_whose_squares_overflow_fp32_stay_finite(rows_overflowing):
    # Elements of 3e19: a row's fp32 sum of squares overflows, and so would the square of its norm.
    grad = torch.randn(3 * RESCUE_ROWS * ROW, generator=torch.Generator().manual_seed(1))
    rows = grad.view(-1, ROW)
    rows[: rows_overflowing * 3 : 3, 5] = 3e19
    total = SumOfSquares(grad)()
    exact = grad.double().square().sum()
    assert torch.isfinite(total)
    assert abs(total - exact) <= 1e-6 * exact


def test_more_overflowing_rows_than_rescued_count_as_non_finite():
    grad = torch.ones((RESCUE_ROWS + 1) * ROW)
    grad.view(-1, ROW)[:, 0] = 3e19
    assert not torch.isfinite(SumOfSquares(grad)())


def test_a_rescued_row_holding_an_inf_stays_non_finite():
    grad = torch.ones(4 * ROW)
    grad[5], grad[ROW + 7] = 3e19, float("inf")
    assert torch.isinf(SumOfSquares(grad)())
    grad[ROW + 7] = float("nan")
    assert torch.isnan(SumOfSquares(grad)())


@pytest.mark.parametrize("folded", [False, True])
def test_sums_another_rank_counts_add_nothing_but_still_carry_a_non_finite_grad(folded):
    # Tensor parallelism: a replicated param's grad counts in the norm on TP rank 0 only, yet a NaN or inf in
    # it must still skip the step on this rank (0 x inf is NaN).
    from graphstep.parallel.collectives import Collectives
    from graphstep.step.stages import StepTensors, norm

    def run(values, counted):
        t = StepTensors.allocate(torch.device("cpu"), None, None)
        if folded:
            class Folded:
                sums = torch.tensor(values, dtype=torch.float64)

                def finish(self):
                    pass

            stage = norm.build_folded([Folded()], t, Collectives(), counted=counted)
        else:
            sums = [lambda v=v: torch.tensor(v, dtype=torch.float64) for v in values]
            stage = norm.build_over(sums, t, Collectives(), counted=counted)
        stage.apply()
        return float(t.grad_norm), bool(t.found_inf)

    assert run([9.0, 16.0, 4.0], [True, True, False]) == (5.0, False)
    assert run([9.0, 16.0, 4.0], [True, True, True]) == (pytest.approx(29.0 ** 0.5), False)
    assert run([9.0, float("inf")], [True, False])[1]
    assert run([9.0, float("nan")], [True, False])[1]
    assert run([4.0], [False]) == (0.0, False)
