"""torch's get_state_dict / set_state_dict with dcp.save / dcp.load for MoE expert params and tensor-parallel
models: saved on 2 gloo ranks (experts: 2 expert data-parallel ranks, or 2 expert-parallel ranks whose experts
are named by their global index) and resumed in one process; TP = 2 saved and loaded back into the same captured
optimizer; TP = 2 x DP = 2 resumed at TP = 2 x DP = 1 and in one process on the whole model. What cannot work is
refused naming what does: experts whose names are local to their expert-parallel rank, pipeline stages.

Every run feeds exact grads (tests/distributed/_torch_api_experts_tp_workers.py), so a resumed run must equal the
uninterrupted one bitwise, element by element of the whole params.
"""

import pytest
import torch

import _torch_api_experts_tp_workers as W
from _harness import spawn, values

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("ep", [1, 2], ids=["expert-dp2", "expert-parallel2"])
def test_experts_saved_on_2_ranks_resume_on_1_bitwise(tmp_path, ep):
    saved = values(spawn(W.experts_save, 2, str(tmp_path), ep, timeout=90))
    assert all(rank["expert_domain"] for rank in saved)  # the experts had a layout of their own
    resumed = values(spawn(W.experts_resume, 1, str(tmp_path), ep, timeout=60))[0]["final"]
    whole = {}
    for rank in saved:
        whole.update(rank["final"])  # expert-parallel ranks: each its own experts, by their global names
    assert set(whole) == set(resumed)
    for name, want in whole.items():
        assert torch.equal(resumed[name], want), name


def test_experts_whose_names_are_local_to_their_rank_are_refused_naming_what_works():
    for result in values(spawn(W.experts_with_local_names, 2, timeout=60)):
        for message in result.values():
            assert message.startswith("ValueError"), message
            assert "expert param 'experts.0." in message and "global index" in message and "opt.state_dict()" in message


def _whole_params(ranks: list) -> dict:
    """The whole params put together from the tensor-parallel ranks' slices (any data-parallel replica)."""
    pieces = {}
    for rank in ranks:
        for name, value in rank["final"].items():
            pieces.setdefault(name, {})[rank["tp_rank"]] = value
    whole = {}
    for name, by_part in pieces.items():
        dim = W.split_dim(name)
        whole[name] = by_part[0] if dim is None else torch.cat([by_part[t] for t in sorted(by_part)], dim)
    return whole


def _loaded_back_bitwise(ranks: list) -> None:
    for rank in ranks:
        assert rank["captured"] and rank["recaptured"] == 0
        for name, want in rank["final"].items():
            assert torch.equal(rank["again"][name], want), name
        for message in rank["refused_full"].values():  # torch's gather assumes an even split: refused
            assert message.startswith("NotImplementedError") and "full_state_dict" in message, message


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_tensor_parallel_2_loads_back_into_its_captured_optimizer_bitwise(tmp_path, optimizer):
    _loaded_back_bitwise(values(spawn(W.tp_save, 2, str(tmp_path), 2, optimizer, timeout=90)))


@pytest.fixture(scope="module", params=[0, 2], ids=["dense", "experts-split-over-tp"])
def tp2_dp2(request, tmp_path_factory):
    """TP = 2 x DP = 2 saved and loaded back on its 4 ranks; with experts, their own layout split over TP."""
    root, experts = str(tmp_path_factory.mktemp("tp2-dp2")), request.param
    ranks = values(spawn(W.tp_save, 4, root, 2, "adam", experts, timeout=120))
    assert all(rank["expert_domain"] == bool(experts) for rank in ranks)
    _loaded_back_bitwise(ranks)
    return root, experts, _whole_params(ranks)


@pytest.mark.parametrize("world, tp", [(2, 2), (1, 1)], ids=["tp2-dp1", "whole-model"])
def test_tensor_times_data_parallel_resumes_at_another_size_bitwise(tp2_dp2, world, tp):
    root, experts, uninterrupted = tp2_dp2
    resumed = _whole_params(values(spawn(W.tp_resume, world, root, 4, tp, "adam", experts, timeout=90)))
    assert set(resumed) == set(uninterrupted)
    for name, want in uninterrupted.items():
        assert torch.equal(resumed[name], want), name


def test_pipeline_stages_are_refused_naming_what_works():
    for result in values(spawn(W.pipeline_refused, 2, timeout=60)):
        message = result["get"]
        assert message.startswith("NotImplementedError"), message
        assert "pipeline stages" in message and "tensor_parallel_group" in message and "torch.save" in message
