"""QK-clip on 2 gloo ranks (distributed optimizer, captured step): the MAX all-reduce makes every rank clip
with the same η, so the ranks agree bitwise, and equal a single process that saw both micro-batches; Muon
with element-wise sharding is refused at build."""

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


def test_muon_with_the_distributed_optimizer_is_refused_with_the_reason():
    messages = values(spawn(workers.muon_refused, 2, timeout=55))
    for message in messages:
        assert "layer-wise sharding" in message and "not supported yet" in message
