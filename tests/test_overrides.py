"""Per-parameter overrides: matching, merging, grouping, standard and MuP overrides, bad input."""

import pytest
import torch

import graphstep as gs
from graphstep.overrides import build_param_groups


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.embed.weight.is_embedding_or_output_parameter = True
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight.is_embedding_or_output_parameter = True


def groups_of(config, overrides=None):
    net = Net()
    groups = build_param_groups(list(net.named_parameters()), config, overrides)
    return {name: group for group in groups for name in group["param_names"]}, groups


def test_fnmatch_semantics_and_or_within_a_key():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    key = gs.ParamKey(name="*.bias")
    assert key.matches(p, "layer.bias") and not key.matches(p, "x.bias.other")
    p.special = True
    either = gs.ParamKey(name="nothing*", attr="special")
    assert either.matches(p, "w")
    predicate = gs.ParamKey(predicate=gs.NamedPredicate("square", lambda q, _: q.shape[0] == q.shape[1]))
    assert predicate.matches(p, "w")


def test_named_predicates_compare_by_name():
    a = gs.NamedPredicate("vec", lambda p, n: p.ndim == 1)
    b = gs.NamedPredicate("vec", lambda p, n: False)
    assert a == b and hash(a) == hash(b)
    assert gs.ParamKey(predicate=a) == gs.ParamKey(predicate=b)


def test_standard_overrides_drop_weight_decay_on_biases_and_1d():
    by_name, groups = groups_of(gs.OptimizerConfig(weight_decay=0.1))
    assert len(groups) == 2
    assert groups[0]["overrides"] == {}  # the group without overrides comes first
    for name in ("proj.bias", "norm.weight", "norm.bias"):
        assert by_name[name]["weight_decay"] == 0.0 and by_name[name]["wd_mult"] == 0.0
    for name in ("embed.weight", "proj.weight", "head.weight"):
        assert by_name[name]["weight_decay"] == 0.1


def test_decoupled_lr_for_embedding_and_output():
    by_name, groups = groups_of(gs.OptimizerConfig(lr=1e-3, decoupled_lr=5e-4, decoupled_min_lr=1e-5))
    assert by_name["embed.weight"]["lr"] == 5e-4 and by_name["embed.weight"]["min_lr"] == 1e-5
    assert by_name["head.weight"] is by_name["embed.weight"]
    assert by_name["proj.weight"]["lr"] == 1e-3 and by_name["proj.weight"]["min_lr"] == 0.0
    assert len(groups) == 3


def test_merging_and_equal_overrides_share_a_group():
    overrides = {gs.ParamKey(name="proj.*"): {"lr_mult": 2.0}, gs.ParamKey(name="*.weight"): {"wd_mult": 0.5},
                 gs.ParamKey(name="head.weight"): {"lr_mult": 2.0}}
    by_name, groups = groups_of(gs.OptimizerConfig(lr=1e-3, weight_decay=0.1), overrides)
    assert by_name["proj.weight"]["overrides"] == {"lr_mult": 2.0, "wd_mult": 0.5}
    assert by_name["proj.weight"] is by_name["head.weight"]
    assert by_name["proj.weight"]["lr"] == 2e-3 and by_name["proj.weight"]["weight_decay"] == 0.05
    assert by_name["proj.bias"]["overrides"] == {"lr_mult": 2.0}
    assert groups[0]["overrides"] == {} and groups[0]["param_names"] == ["norm.bias"]  # unmatched: first


def test_conflicting_overrides_name_the_param_and_both_keys():
    overrides = {gs.ParamKey(name="proj.*"): {"max_lr": 1.0}, gs.ParamKey(attr="is_embedding_or_output_parameter"):
                 {"max_lr": 2.0}, gs.ParamKey(name="*.weight"): {"max_lr": 3.0}}
    with pytest.raises(ValueError, match=r"param 'embed.weight'.*max_lr=2.0.*max_lr=3.0"):
        groups_of(gs.OptimizerConfig(), overrides)


@pytest.mark.parametrize("width, rule, expect", [
    (2.0, "adam", {"proj.weight": (5e-4, 5e-9), "embed.weight": (1e-3, 1e-8), "norm.weight": (1e-3, 1e-8)}),
    (2.0, "sgd", {"proj.weight": 1e-3, "norm.weight": 2e-3, "embed.weight": 2e-3}),
    (1.0, "adam", {"proj.weight": (1e-3, 1e-8)}),
])
def test_mup_overrides(width, rule, expect):
    config = gs.OptimizerConfig(optimizer=rule, lr=1e-3, adam_eps=1e-8)
    overrides = {**gs.get_standard_config_overrides(config), **gs.get_mup_config_overrides(config, width)}
    by_name, _ = groups_of(config, overrides)
    for name, want in expect.items():
        got = (by_name[name]["lr"], by_name[name]["eps"]) if rule == "adam" else by_name[name]["lr"]
        assert got == pytest.approx(want)


def test_mup_keeps_decoupled_lr_params_on_their_decoupled_values():
    config = gs.OptimizerConfig(optimizer="sgd", lr=1e-3, decoupled_lr=3e-4)
    overrides = {**gs.get_standard_config_overrides(config), **gs.get_mup_config_overrides(config, 4.0)}
    by_name, _ = groups_of(config, overrides)
    assert by_name["embed.weight"]["lr"] == 3e-4
    assert by_name["norm.weight"]["lr"] == pytest.approx(4e-3)


BAD = [
    (lambda: gs.ParamKey(), ValueError, "at least one"),
    (lambda: gs.ParamKey(name=3), TypeError, "ParamKey.name"),
    (lambda: gs.ParamKey(name=""), ValueError, "empty name glob"),
    (lambda: gs.ParamKey(predicate=lambda p, n: True), TypeError, "ParamKey.predicate"),
    (lambda: groups_of(gs.OptimizerConfig(), {gs.ParamKey(name="*"): {"lr": 1.0}}), ValueError, "use max_lr"),
    (lambda: groups_of(gs.OptimizerConfig(), {gs.ParamKey(name="*"): {"optimizer": "sgd"}}), ValueError,
     "setting of the whole optimizer"),
    (lambda: groups_of(gs.OptimizerConfig(), {gs.ParamKey(name="*"): {"max_lr": -1.0}}), ValueError, "max_lr=-1.0"),
    (lambda: groups_of(gs.OptimizerConfig(), {gs.ParamKey(name="*"): {"eps": 0.0}}), ValueError, "eps=0.0"),
    (lambda: groups_of(gs.OptimizerConfig(), {gs.ParamKey(name="*"): {"wd_mult": "x"}}), ValueError, "finite"),
    (lambda: groups_of(gs.OptimizerConfig(), {"*.bias": {"wd_mult": 0.0}}), TypeError, "expected a ParamKey"),
    (lambda: groups_of(gs.OptimizerConfig(), {gs.ParamKey(name="*"): 0.5}), TypeError, "ParamGroupOverride"),
    (lambda: gs.get_mup_config_overrides(gs.OptimizerConfig(), 0.0), ValueError, "mup_width_mult"),
]


@pytest.mark.parametrize("make, error, message", BAD)
def test_bad_override_input_names_what_is_wrong(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_get_optimizer_checks_overrides_and_uses_them():
    net = Net()
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="eager"), net, {gs.ParamKey(name="head.*"): {"lr_mult": 0.5}})
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 5e-4]
    with pytest.raises(ValueError, match="unknown key"):
        gs.get_optimizer(gs.OptimizerConfig(), Net(), {gs.ParamKey(name="*"): {"betas": (0.9, 0.9)}})
