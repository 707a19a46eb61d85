"""The fold's parts (graphstep/step/folded_sums.py explains the fold): the bookkeeping of a bucket landed in
backward lives with the folded sums, not with the hook that lands it."""

import torch

from graphstep.step.folded_sums import ShardSums
from graphstep.step.stages.norm import SumOfSquares


def test_a_bucket_landed_in_backward_is_folded_counted_and_skipped_once_by_the_step():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(3 * 4096 + 17, generator=g), torch.randn(300, generator=g)]
    sums = ShardSums(grads)
    sums.land(0)
    assert torch.equal(sums.sums[0], SumOfSquares(grads[0])()) and sums.sums[1] == 0
    assert sums.in_backward_folds == 1 and sums.before_step_folds == 0
    assert sums.take_landed(0) and not sums.take_landed(0) and not sums.take_landed(1)
