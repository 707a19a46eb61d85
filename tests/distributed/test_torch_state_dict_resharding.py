"""torch's get_state_dict / set_state_dict with dcp.save / dcp.load across ranks: the distributed optimizer saved
on 2 gloo ranks resumes on 1 (the pieces resharded by DCP), a DDP run resumes in one process on a plain model,
layer-wise Muon and CPU offload too (expert params and tensor parallelism:
test_torch_api_experts_tp.py).

Every run feeds exact grads (tests/distributed/_torch_api_workers.py), so the resumed runs must equal the
uninterrupted 2-rank run bitwise, and the state loaded on 1 rank must equal the 2 ranks' saved pieces put together.
"""

import pytest
import torch

import _torch_api_workers as W
from _harness import spawn, values

pytestmark = pytest.mark.distributed
NAMES = ("sgd", "adam", "adam_offload", "layerwise")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("torch-api"))
    return root, values(spawn(W.save, 2, root, NAMES, timeout=90))


def _assembled(rank_results: list, name: str) -> dict:
    """The saved state of every param, put together from the ranks' pieces."""
    pieces = {}
    for result in rank_results:
        for key, (start, tensor) in result[name]["saved"].items():
            pieces.setdefault(key, []).append((start, tensor))
    full = {}
    for key, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        full[key] = parts[0][1] if key[0] == "step" else torch.cat([t for _, t in parts])
    return full


@pytest.mark.parametrize("name", NAMES)
def test_distributed_optimizer_saved_on_2_ranks_resumes_on_1_bitwise(saved, name):
    root, results = saved
    resumed = values(spawn(W.resume, 1, root, (name,), timeout=60))[0][name]
    if name != "layerwise":
        assert max(r[name]["pieces"] for r in results) > 1  # some rank's range of a param spans several boxes
    full = _assembled(results, name)
    assert set(resumed["loaded"]) == set(full)
    for key, (_, tensor) in resumed["loaded"].items():
        assert torch.equal(tensor, full[key]), key
    for param, want in results[0][name]["final"].items():
        assert torch.equal(resumed["final"][param], want), param


def test_distributed_optimizer_saved_on_2_ranks_resumes_on_2_bitwise(saved):
    # Some rank owns none of some param (BUCKET): its entry must still be one DCP loads into.
    root, results = saved
    for rank, resumed in enumerate(values(spawn(W.resume, 2, root, ("adam",), timeout=60))):
        for param, want in results[rank]["adam"]["final"].items():
            assert torch.equal(resumed["adam"]["final"][param], want), param


def test_full_state_dict_with_the_distributed_optimizer_is_refused_clearly(saved):
    _, results = saved
    for result in results:
        for message in result["sgd"]["full_refused"].values():  # get_state_dict and set_optimizer_state_dict
            assert message.startswith("NotImplementedError") and "full_state_dict" in message, message


def test_ddp_run_resumes_in_one_process_on_a_plain_model_bitwise(tmp_path):
    saved = values(spawn(W.ddp_save, 2, str(tmp_path), timeout=60))
    assert saved[0]["keys"] == saved[0]["names"]  # FQNs without DDP's "module."
    resumed = values(spawn(W.ddp_resume_alone, 1, str(tmp_path), timeout=60))[0]
    for param, want in saved[0]["final"].items():
        assert torch.equal(resumed["final"][param], want), param
