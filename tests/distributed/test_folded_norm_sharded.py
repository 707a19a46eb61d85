"""fold_grad_norm with the distributed optimizer on 2 and 4 gloo ranks.

With several ranks each bucket's sum of squares is folded as its reduce-scatter lands (in the step, or in
backward with ``overlap_grad_reduce``): the same sums of the same shards in the same order as the unfolded
norm, so every variant (plain, overlapped, with half of each shard's update offloaded to the CPU) is bitwise
the unfolded step, and the captured folded step is bitwise the eager one.
Against one process (the oracle of every multi-rank run) only the reduction order differs: SGD in fp32,
within docs/design.md §8's rounding-level drift.
"""

import functools

import pytest
import torch

from _harness import relative_drift, spawn, values
from toy import tiny_transformer
import _fold_workers as W

pytestmark = pytest.mark.distributed

MICRO_BATCHES = (1, 2, 3, 4)


@functools.lru_cache(maxsize=None)
def runs(world_size: int) -> list:
    return values(spawn(W.folded, world_size, timeout=58))


@functools.lru_cache(maxsize=None)
def one_process(micro_batches: int) -> dict:
    return W.train(0, 1, micro_batches, (micro_batches - 1) // 2, fold_grad_norm=True)


def same(a: dict, b: dict) -> bool:
    return a["ok"] == b["ok"] and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", ["fold", "fold_overlap", "fold_both_overlaps", "fold_offload"])
def test_every_folded_variant_is_bitwise_the_unfolded_step(world_size, variant):
    for rank, result in enumerate(runs(world_size)):
        for micro in MICRO_BATCHES:
            assert same(result[(variant, micro)], result[("plain", micro)]), f"rank {rank}, {micro} micro-batches"


@pytest.mark.parametrize("world_size", [2, 4])
def test_an_inf_in_any_micro_batch_of_one_rank_skips_the_step_everywhere(world_size):
    for result in runs(world_size):
        for micro in MICRO_BATCHES:
            for variant in W.VARIANTS:
                expected = [step != W.INF_STEP for step in range(W.STEPS)]
                assert result[(variant, micro)]["ok"] == expected, (variant, micro)


@pytest.mark.parametrize("world_size", [2, 4])
def test_overlap_lands_buckets_in_backward_and_folds_them_there(world_size):
    for result in runs(world_size):
        for micro in MICRO_BATCHES:
            overlapped = result[("fold_overlap", micro)]
            # Every bucket but the last of each backward is landed by the hook that launches the next one.
            assert overlapped["launched"] > 0
            assert 0 < overlapped["folds"]["in_backward"] < overlapped["launched"]
            assert overlapped["folds"]["before_step"] == 0
            assert result[("fold", micro)]["folds"] == {"in_backward": 0, "before_step": 0}


@pytest.mark.parametrize("world_size", [2, 4])
def test_captured_folded_step_equals_eager_bitwise(world_size):
    for result in runs(world_size):
        assert result[("capture", "graph")]["captured"]
        assert same(result[("capture", "graph")], result[("capture", "eager")])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_match_one_process_with_the_folded_norm(world_size):
    start = list(tiny_transformer().parameters())
    for result in runs(world_size):
        for micro in MICRO_BATCHES:
            reference = one_process(micro)
            assert result[("fold", micro)]["ok"] == reference["ok"]
            assert relative_drift(result[("fold", micro)]["params"], reference["params"], start) <= 1e-5
