"""What graphstep does not take is refused up front, with the way that works: graphstep's own reshardable
format handed to torch's set_state_dict (which takes torch's format: tests/test_torch_state_dict_api.py); and a
cast of the user's model (bf16 / fp16 / params_dtype) is said once at build, never silent."""

import warnings

import pytest
import torch

import graphstep as gs


def tensors_of(tree) -> list:
    """Every tensor in a state dict, cloned, in a fixed order."""
    if isinstance(tree, torch.Tensor):
        return [tree.detach().clone()]
    if isinstance(tree, dict):
        return [t for key in sorted(tree, key=str) for t in tensors_of(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in tensors_of(item)]
    return []


def trained_engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2, capture="eager"), model)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def test_torchs_set_state_dict_refuses_graphsteps_own_format_and_changes_nothing(one_rank_group):
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, set_state_dict
    model, opt = trained_engine()
    saved = gs.checkpoint.get_optimizer_state_dict(model, opt)
    before = tensors_of(opt.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    for call in (lambda: set_state_dict(model, opt, model_state_dict=model.state_dict(), optim_state_dict=saved),
                 lambda: set_optimizer_state_dict(model, opt, saved)):
        with pytest.raises(Exception):  # graphstep's own format, given to torch's functions
            call()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    after = tensors_of(opt.state_dict())
    assert len(after) == len(before) > 0 and all(torch.equal(a, b) for a, b in zip(after, before))


def test_the_state_mapping_still_answers_everyone_else():
    _, opt = trained_engine()
    assert opt.state and len(opt.state) == 4
    assert all(entry["step"] is opt.tensors.step for entry in opt.state.values())


@pytest.mark.parametrize("setting, target", [(dict(bf16=True), torch.bfloat16), (dict(fp16=True), torch.float16),
                                             (dict(bf16=True, params_dtype=torch.bfloat16), torch.bfloat16)])
def test_casting_the_users_model_is_said_once_at_build(setting, target):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gs.get_optimizer(gs.OptimizerConfig(capture="eager", **setting), model)
    cast = [w for w in seen if "casts the model's params" in str(w.message)]
    assert len(cast) == 1 and str(target) in str(cast[0].message) and "4 from torch.float32" in str(cast[0].message)
    assert cast[0].filename == __file__  # points at the caller's get_optimizer line
    assert all(p.dtype == target for p in model.parameters())


def test_a_model_already_in_the_configured_dtype_is_not_warned_about():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gs.get_optimizer(gs.OptimizerConfig(capture="eager", bf16=True), model)
    assert not [w for w in seen if "casts the model's params" in str(w.message)]
