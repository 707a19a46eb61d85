"""Layer-wise Muon checkpoints reload at another data-parallel size (graphstep's sharded format).

Saved on 2 gloo ranks (each rank writes the whole matrices it owns, per param, model-named), resumed on 4
ranks (other owners) and in one process, then trained on: every rank feeds the same exact grads (the mean
of 4 ranks' multiples of 2⁻¹⁰, so any power-of-two data-parallel size reduces them bitwise alike), so the
resumed runs must equal the uninterrupted 2-rank run bitwise, Muon's momentum buffers included (a lost
buffer would change the next Newton–Schulz input).
"""

import pytest
import torch

import _layerwise_workers as W
from _harness import spawn, values

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("layerwise-ckpt"))
    return root, values(spawn(W.save_checkpoint, 2, root, timeout=55))


def _check(resumed: list, saved_results: list) -> None:
    reference = saved_results[0]
    for rank, result in enumerate(resumed):
        for name, want in reference["at_save"].items():
            assert torch.equal(result["at_load"][name], want), f"rank {rank}: '{name}' after the load"
        for name, want in reference["final"].items():
            assert torch.equal(result["final"][name], want), f"rank {rank}: '{name}' after training on"


def test_saved_on_2_ranks_resumes_on_4_bitwise(saved):
    root, results = saved
    resumed = values(spawn(W.resume_checkpoint, 4, root, timeout=55))
    assert results[0]["owners"] != resumed[0]["owners"]  # the matrices changed hands
    _check(resumed, results)


def test_saved_on_2_ranks_resumes_in_one_process_bitwise(saved):
    root, results = saved
    _check([W.resume_checkpoint(0, 1, root)], results)
