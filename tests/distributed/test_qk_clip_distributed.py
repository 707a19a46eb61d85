"""QK-clip on 2 gloo ranks (distributed optimizer, captured step): the MAX all-reduce makes every rank clip
with the same η, so the ranks agree bitwise, and equal a single process that saw both micro-batches; the
same with Muon, whose matrices are sharded layer-wise (the clip then scales rows of whole matrices on
their owner, and the all-gather publishes them)."""

import pytest
import torch

from _harness import spawn, values
import _qk_clip_workers as workers

pytestmark = pytest.mark.distributed


def test_two_ranks_clip_alike_and_match_a_single_process_bitwise():
    ranks = values(spawn(workers.train, 2, timeout=55))
    single = workers.train(0, 1, micro_batches=2)
    assert all(r["captured"] for r in ranks)
    for rank in ranks:
        for got, want in zip(rank["params"], single["params"]):
            assert torch.equal(got, want)
    # The clip was active, and needed the other rank's maxima: on some step a query group crossed τ on one
    # rank only (without the MAX all-reduce the other rank would have left it unclipped).
    over = [torch.stack(r["maxima"]).view(workers.STEPS, workers.GROUPS, -1).amax(dim=2) > workers.THRESHOLD
            for r in ranks]
    assert (over[0] != over[1]).any()


def test_muon_sharded_layer_wise_clips_like_a_single_process_bitwise():
    ranks = values(spawn(workers.muon_layerwise, 2, timeout=55))
    single = workers.train(0, 1, micro_batches=2, optimizer="muon")
    start = workers.Attention()
    assert all(r["captured"] for r in ranks)
    for rank in ranks:
        for got, want in zip(rank["params"], single["params"]):
            assert torch.equal(got, want)
    assert not torch.equal(single["params"][0], start.q.weight)  # the clip moved W_q
