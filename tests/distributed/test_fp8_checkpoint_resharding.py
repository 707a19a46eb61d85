"""fp8 weights in a distributed checkpoint: saved on 2 gloo ranks with ``graphstep.checkpoint.save``, loaded
on 2 and on 4. The fp8 bytes, scale, scale_inv and amax history come back bitwise at either size (they are
replicated across ranks and saved once per weight); at the same size the next steps are bitwise those of
the uninterrupted run (at another size only the grad reduction order differs, docs/design.md §8)."""

import pytest
import torch

import _fp8_workers as workers
from _harness import spawn, values

pytestmark = pytest.mark.distributed
RECIPES = ("tensorwise", "delayed")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fp8ckpt"))
    return root, values(spawn(workers.checkpoint_then_continue, 2, root, timeout=120))


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp8_state_reloads_bitwise_and_same_size_resume_is_bitwise(saved, world_size):
    root, runs = saved
    resumed = values(spawn(workers.resume_from_checkpoint, world_size, root, timeout=120))
    for recipe in RECIPES:
        reference = runs[0][recipe]
        assert all(same(r[recipe]["at_save"], reference["at_save"]) for r in runs)  # replicated on the ranks
        for rank, result in enumerate(resumed):
            run = result[recipe]
            assert not same(run["fresh"], reference["at_save"])  # the load had work to do
            assert same(run["at_load"], reference["at_save"]), f"{recipe} rank {rank}: loaded state differs"
            if world_size == 2:
                assert same(run["final"], reference["final"]), f"{recipe} rank {rank}: resume not bitwise"
