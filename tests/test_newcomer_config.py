"""What a newcomer types into OptimizerConfig: a misspelled field gets a "did you mean" (still a TypeError, from
the constructor, ``replace`` and ``dataclasses.replace``), and "adamw" is accepted as the name of Adam with
decoupled weight decay, normalised to "adam" everywhere it names a family."""

import dataclasses

import pytest
import torch

import graphstep as gs
from graphstep.plan.routing import build_family_param_groups
from graphstep.config import OptimizerConfig


# ---- misspelled fields ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: OptimizerConfig(lrr=1e-3),
    lambda: OptimizerConfig().replace(lrr=1e-3),
    lambda: dataclasses.replace(OptimizerConfig(), lrr=1e-3),
], ids=["constructor", "replace", "dataclasses.replace"])
def test_a_misspelled_field_suggests_the_right_one(make):
    with pytest.raises(TypeError, match=r"OptimizerConfig has no field 'lrr': did you mean 'lr'\?"):
        make()


def test_the_suggestion_is_the_closest_field():
    with pytest.raises(TypeError, match=r"'adam_beta': did you mean 'adam_beta1'"):
        OptimizerConfig(adam_beta=0.9)
    with pytest.raises(TypeError, match=r"'weight_decy': did you mean 'weight_decay'"):
        OptimizerConfig(lr=1e-3, weight_decy=0.1)


def test_a_name_like_no_field_says_where_the_fields_are():
    with pytest.raises(TypeError, match="OptimizerConfig has no field 'zzz'") as info:
        OptimizerConfig(zzz=1)
    assert "did you mean" not in str(info.value) and "graphstep/config/__init__.py" in str(info.value)


def test_every_unknown_keyword_is_named():
    with pytest.raises(TypeError, match=r"no fields 'lrr' \(did you mean 'lr'\?\), 'clip_grads' \(did you mean "
                                        r"'clip_grad'\?\)"):
        OptimizerConfig(lrr=1e-3, clip_grads=1.0)


def test_good_keywords_and_positional_arguments_still_work():
    assert OptimizerConfig(lr=0.5).lr == 0.5
    assert OptimizerConfig("sgd", 0.25).optimizer == "sgd"
    assert dataclasses.replace(OptimizerConfig(), lr=0.5) == OptimizerConfig(lr=0.5)
    with pytest.raises(TypeError):  # Python's own checks are still Python's
        OptimizerConfig("sgd", optimizer="adam")


# ---- "adamw" -------------------------------------------------------------------------------------------------

def test_adamw_is_adam_with_decoupled_weight_decay():
    config = OptimizerConfig(optimizer="adamw")
    assert config.optimizer == "adam" and config.decoupled_weight_decay
    assert config == OptimizerConfig(optimizer="adam")
    assert OptimizerConfig(optimizer="sgd").replace(optimizer="adamw").optimizer == "adam"
    assert OptimizerConfig(optimizer="muon", muon_scalar_optimizer="adamw").muon.scalar_optimizer == "adam"


def test_adamw_with_l2_weight_decay_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"optimizer='adamw'.*decoupled_weight_decay=False.*optimizer='adam'"):
        OptimizerConfig(optimizer="adamw", decoupled_weight_decay=False)


def test_adamw_steps_like_torch_adamw():
    """Oracle: torch.optim.AdamW(fused=True), bitwise (the fused kernel, sizes a multiple of 16)."""
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(32, 16, bias=False), torch.nn.Linear(32, 16, bias=False)
    theirs.load_state_dict(ours.state_dict())
    config = OptimizerConfig(optimizer="adamw", lr=1e-2, weight_decay=0.1, clip_grad=0.0, kernel="fused",
                             capture="eager")
    opt = gs.get_optimizer(config, ours, config_overrides={})
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
        for model, optimizer in ((ours, opt), (theirs, ref)):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert torch.equal(ours.weight, theirs.weight)
    opt.close()


def test_an_override_may_name_adamw():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    named = list(model.named_parameters())
    groups = build_family_param_groups(named, OptimizerConfig(optimizer="sgd"),
                                       {gs.ParamKey(name="1.*"): {"optimizer": "adamw"}})
    by_name = {name: group for group in groups for name in group["param_names"]}
    assert by_name["1.weight"]["optimizer"] == "adam" and by_name["0.weight"]["optimizer"] == "sgd"
    assert by_name["1.weight"]["overrides"]["optimizer"] == "adam"
    with pytest.raises(ValueError, match=r"optimizer='adamw'.*decoupled_weight_decay=False"):
        build_family_param_groups(named, OptimizerConfig(optimizer="sgd", decoupled_weight_decay=False),
                                  {gs.ParamKey(name="1.*"): {"optimizer": "adamw"}})
