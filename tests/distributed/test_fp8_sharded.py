"""fp8 weights with the distributed optimizer on 2 and 4 gloo ranks.

Each rank requantizes its slice of every fp8 weight after the amax MAX all-reduce, so all ranks hold the
same scales and, after the all-gather of fp8 bytes, bitwise-identical weights. One rank's injected inf
skips the step on all ranks with every fp8 byte unchanged. The all-gather of an fp8 buffer moves 1 byte
per element (counted at the Collectives call). Against a single-process run on the global batch only the
grad reduction order differs.
"""

import pytest
import torch

from _harness import relative_drift, spawn, values
import _fp8_workers as workers

pytestmark = pytest.mark.distributed
RECIPES = ("tensorwise", "delayed")


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def ranks(request):
    world_size = request.param
    return world_size, values(spawn(workers.both_recipes, world_size, timeout=120))


@pytest.mark.parametrize("recipe", RECIPES)
def test_all_ranks_hold_identical_fp8_bytes_and_scales_after_every_step(ranks, recipe):
    world_size, results = ranks
    for rank, result in enumerate(results[1:], start=1):
        for step, (mine, first) in enumerate(zip(result[recipe]["steps"], results[0][recipe]["steps"])):
            for key in ("bytes", "scale", "scale_inv", "history"):
                assert all(torch.equal(a, b) for a, b in zip(mine[key], first[key])), \
                    f"rank {rank}/{world_size}, step {step}: {key} differs from rank 0's ({recipe})"


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_rank_inf_skips_on_all_ranks_with_fp8_state_unchanged(ranks, recipe):
    world_size, results = ranks
    expected = [step != workers.INF_STEP for step in range(workers.STEPS)]
    for rank, result in enumerate(results):
        steps = result[recipe]["steps"]
        assert [s["ok"] for s in steps] == expected, f"rank {rank}/{world_size}"
        before, skipped, after = steps[workers.INF_STEP - 1], steps[workers.INF_STEP], steps[workers.INF_STEP + 1]
        for key in ("bytes", "scale", "scale_inv", "history"):
            assert all(torch.equal(a, b) for a, b in zip(before[key], skipped[key])), f"rank {rank}: {key}"
        assert not all(torch.equal(a, b) for a, b in zip(skipped["bytes"], after["bytes"]))


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_all_gather_moves_one_byte_per_fp8_element(ranks, recipe):
    world_size, results = ranks
    for result in results:
        r = result[recipe]
        fp8_bytes = sum(n for dtype, n in r["gathered"] if dtype == "torch.float8_e4m3fn")
        assert fp8_bytes == workers.STEPS * r["fp8_buffer_numel"]  # 1 B/element, every step
        assert r["fp8_buffer_numel"] < r["fp8_numel"] + 128 * world_size * 4  # the weights plus bucket padding
        other = sum(n for dtype, n in r["gathered"] if dtype != "torch.float8_e4m3fn")
        assert other == workers.STEPS * r["other_buffer_bytes"]  # the bf16 params: 2 B/element


@pytest.mark.parametrize("recipe", RECIPES)
def test_matches_a_single_process_run_on_the_global_batch(ranks, recipe):
    world_size, results = ranks
    single = workers.train(recipe, 0, 1)
    start = [p.float() for p in workers.tiny_transformer().parameters()]
    drift = relative_drift(results[0][recipe]["params"], single["params"], start)
    assert drift < 1e-1, f"{world_size} ranks: drift {drift:.2e} of the motion ({recipe})"
    assert [s["ok"] for s in single["steps"]] == [s["ok"] for s in results[0][recipe]["steps"]]


def test_captured_step_equals_eager_on_two_ranks():
    results = values(spawn(workers.capture_vs_eager, 2, timeout=120))
    for rank, result in enumerate(results):
        assert result["graph"]["captured"] and not result["eager"]["captured"]
        for step, (e, g) in enumerate(zip(result["eager"]["steps"], result["graph"]["steps"])):
            assert e["ok"] == g["ok"]
            for key in ("bytes", "scale", "scale_inv", "history"):
                assert all(torch.equal(a, b) for a, b in zip(e[key], g[key])), f"rank {rank}, step {step}: {key}"


def test_deferred_fp8_all_gathers_give_the_same_bytes_as_plain_ones():
    results = values(spawn(workers.overlap_vs_plain, 2, timeout=120))
    for rank, result in enumerate(results):
        assert result[True]["counts"]["waited_gathers"] > 0  # the forward hooks did wait on deferred gathers
        assert all(torch.equal(a, b) for a, b in zip(result[False]["params"], result[True]["params"])), rank
