"""Param groups against Megatron-Core's own ``_get_param_groups`` and ``get_standard_config_overrides``.

Run on the CPU with megatron-core 0.16.1 (skipped where it is not installed); for what these tests touch,
its ``megatron/core/optimizer/__init__.py`` and the newest source of NVIDIA/Megatron-LM agree (the newest
applies the standard overrides in ``get_megatron_optimizer`` instead of ``_get_param_groups``; the tests
pass them explicitly). Groups are compared by their params, in order, and by what the schedule reads.
"""

import warnings

import pytest
import torch

import graphstep as gs
from graphstep.plan.overrides import ParamKey, build_param_groups


@pytest.fixture
def megatron(monkeypatch):
    """``megatron.core.optimizer``, with the one collective ``_get_param_groups`` runs (an all-gather of
    the group keys, to align ranks) answered for a single process."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that Transformer Engine and Apex are missing
        module = pytest.importorskip("megatron.core.optimizer", reason="megatron-core is not installed")

    def all_gather_object(out, obj, group=None):
        out[0] = obj

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    return module


class Model(torch.nn.Module):
    """A GPT-like layer named as Megatron-Core's models are: a marked embedding and output layer, layernorms,
    and attention with q_layernorm / k_layernorm (weight and bias each)."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 8)
        self.embedding.weight.is_embedding_or_output_parameter = True
        self.input_layernorm = torch.nn.LayerNorm(8)
        self.self_attention = torch.nn.Module()
        self.self_attention.linear_qkv = torch.nn.Linear(8, 24)
        self.self_attention.q_layernorm = torch.nn.LayerNorm(4)
        self.self_attention.k_layernorm = torch.nn.LayerNorm(4)
        self.self_attention.linear_proj = torch.nn.Linear(8, 8)
        self.final_layernorm = torch.nn.LayerNorm(8)
        self.output_layer = torch.nn.Linear(8, 10, bias=False)
        self.output_layer.weight.is_embedding_or_output_parameter = True


SCHEDULE_KEYS = ("wd_mult", "lr_mult", "max_lr", "min_lr")


def ours(model, config, overrides=None) -> list:
    groups = build_param_groups(list(model.named_parameters()), config, overrides)
    return [(group["param_names"], *(group[key] for key in SCHEDULE_KEYS)) for group in groups]


def theirs(megatron, model, config, overrides) -> list:
    names = {id(param): name for name, param in model.named_parameters()}
    groups = megatron._get_param_groups([model], config, overrides)
    return [([names[id(p)] for p in group["params"]], *(group[key] for key in SCHEDULE_KEYS)) for group in groups]


@pytest.mark.parametrize("decoupled_lr", [None, 5e-4])
@pytest.mark.parametrize("apply_wd_to_qk_layernorm", [False, True])
def test_standard_groups_are_megatron_cores(megatron, apply_wd_to_qk_layernorm, decoupled_lr):
    fields = dict(lr=1e-3, min_lr=1e-5, weight_decay=0.1, decoupled_lr=decoupled_lr,
                  apply_wd_to_qk_layernorm=apply_wd_to_qk_layernorm)
    config, their_config = gs.OptimizerConfig(**fields), megatron.OptimizerConfig(**fields)
    model = Model()
    expected = theirs(megatron, model, their_config, megatron.get_standard_config_overrides(their_config))
    assert ours(model, config) == expected
    wd_of = {name: group[1] for group in expected for name in group[0]}
    assert wd_of["self_attention.q_layernorm.weight"] == wd_of["self_attention.k_layernorm.bias"] == \
        (1.0 if apply_wd_to_qk_layernorm else 0.0)
    assert wd_of["final_layernorm.weight"] == wd_of["self_attention.linear_qkv.bias"] == 0.0


# (name globs, override): the same overrides written once for each side's ParamKey.
OVERRIDES = [
    [("*.bias", {})],  # one empty override: its params get a group of their own, second
    [("*.bias", {}), ("embedding.*", {"wd_mult": 0.5}), ("*layernorm.*", {"lr_mult": 0.5})],
    [("*", {}), ("output_layer.*", {"max_lr": 2e-3})],  # every param matched: no no-override group
    [("*q_layernorm.*", {"wd_mult": 0.0}), ("*k_layernorm.*", {"wd_mult": 0.0, "min_lr": 1e-6})],
]


@pytest.mark.parametrize("spec", OVERRIDES, ids=lambda spec: "+".join(glob for glob, _ in spec))
def test_groups_and_their_order_under_overrides_are_megatron_cores(megatron, spec):
    config, their_config = gs.OptimizerConfig(lr=1e-3, min_lr=1e-5), megatron.OptimizerConfig(lr=1e-3, min_lr=1e-5)
    model = Model()
    expected = theirs(megatron, model, their_config, {megatron.ParamKey(name=glob): dict(o) for glob, o in spec})
    assert ours(model, config, {ParamKey(name=glob): dict(o) for glob, o in spec}) == expected


def test_megatron_core_accepts_a_group_min_lr_above_its_max_lr(megatron):
    """README, Differences from Megatron-Core: graphstep refuses the override (tests/test_overrides.py);
    Megatron-Core builds the group, and its scheduler climbs from max_lr to min_lr (tests/test_scheduler.py)."""
    model = Model()
    spec = {"max_lr": 1e-5, "min_lr": 1e-4}
    their_overrides = {megatron.ParamKey(name="output_layer.*"): spec}
    groups = theirs(megatron, model, megatron.OptimizerConfig(lr=1e-3), their_overrides)
    assert (["output_layer.weight"], 1.0, 1.0, 1e-5, 1e-4) in groups
    with pytest.raises(ValueError, match="min_lr=0.0001 exceeds max_lr=1e-05"):
        ours(model, gs.OptimizerConfig(lr=1e-3), {ParamKey(name="output_layer.*"): spec})
