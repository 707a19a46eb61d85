"""Per-parameter overrides: matching, merging, grouping, standard and MuP overrides, bad input."""

import pytest
import torch

import graphstep as gs
from graphstep.plan.overrides import (NamedPredicate, ParamKey, build_param_groups, check_config_overrides_consistency,
                                       get_mup_config_overrides, get_standard_config_overrides)


class Net(torch.nn.Module):
    """embed (2-D, embedding), proj (Linear with bias), norm (LayerNorm: two 1-D), head (2-D, output).

    Marked as Megatron-Core's language models mark them: the embedding with ``is_embedding_parameter``
    and ``is_embedding_or_output_parameter``, the output layer with the latter only."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.embed.weight.is_embedding_parameter = True
        self.embed.weight.is_embedding_or_output_parameter = True
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight.is_embedding_or_output_parameter = True


def groups_of(config, overrides=None):
    groups = build_param_groups(list(Net().named_parameters()), config, overrides)
    return {name: group for group in groups for name in group["param_names"]}, groups


def summary(groups, *fields):
    """Per group: its param names and the listed fields, for exact comparisons."""
    return [(g["param_names"], *(g[f] for f in fields)) for g in groups]


# ---- matching ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("glob, name, hit", [
    ("*.bias", "layer.bias", True), ("*.bias", "x.bias.other", False), ("*.bias", "bias", False),
    ("layer.*", "layer.0.weight", True),  # fnmatch's * crosses dots
    ("layer.?.weight", "layer.3.weight", True), ("layer.[01].weight", "layer.2.weight", False),
    ("*.Bias", "layer.bias", False),  # case-sensitive on every platform (fnmatchcase)
])
def test_name_globs_follow_fnmatchcase(glob, name, hit):
    assert ParamKey(name=glob).matches(torch.nn.Parameter(torch.zeros(2)), name) is hit


def test_any_listed_item_matches():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    square = NamedPredicate("square", lambda q, _: q.shape[0] == q.shape[1])
    assert ParamKey(name=("nope", "w*")).matches(p, "weight")  # the second glob
    assert not ParamKey(name="nope", attr="special").matches(p, "w")
    p.special = True
    assert ParamKey(name="nope", attr="special").matches(p, "w")  # the attr alone
    p.special = False
    assert not ParamKey(attr="special").matches(p, "w")  # attrs must be truthy, not merely present
    assert ParamKey(name="nope", predicate=square).matches(p, "w")  # the predicate alone
    assert not ParamKey(predicate=square).matches(torch.nn.Parameter(torch.zeros(2, 3)), "w")


def test_named_predicates_compare_and_hash_by_name():
    a = NamedPredicate("vec", lambda p, n: p.ndim == 1)
    b = NamedPredicate("vec", lambda p, n: False)
    assert a == b and hash(a) == hash(b) and a != NamedPredicate("mat", a.fn)
    assert ParamKey(predicate=a) == ParamKey(predicate=b)
    assert hash(ParamKey(name=["x", "y"])) == hash(ParamKey(name=("x", "y")))  # lists are frozen to tuples
    with pytest.raises(AttributeError):
        ParamKey(name="x").name = ("y",)


# ---- merging and grouping ----------------------------------------------------------------------------

def test_merging_and_equal_overrides_share_a_group():
    overrides = {ParamKey(name="proj.*"): {"lr_mult": 2.0}, ParamKey(name="*.weight"): {"wd_mult": 0.5},
                 ParamKey(name="head.weight"): {"lr_mult": 2.0}}  # agrees with proj.* where both match
    by_name, groups = groups_of(gs.OptimizerConfig(lr=1e-3, weight_decay=0.1), overrides)
    assert summary(groups, "overrides", "lr", "weight_decay") == [
        (["norm.bias"], {}, 1e-3, 0.1),  # no override: first
        (["proj.bias"], {"lr_mult": 2.0}, 1e-3 * 2.0, 0.1),  # then sorted by the (key, value) pairs
        (["proj.weight", "head.weight"], {"lr_mult": 2.0, "wd_mult": 0.5}, 1e-3 * 2.0, 0.1 * 0.5),
        (["embed.weight", "norm.weight"], {"wd_mult": 0.5}, 1e-3, 0.1 * 0.5),
    ]
    assert by_name["proj.weight"]["max_lr"] == 1e-3 and by_name["proj.weight"]["lr_mult"] == 2.0


def test_the_no_override_group_comes_first_even_when_its_params_come_last():
    overrides = {ParamKey(name=("embed.*", "proj.*", "norm.*")): {"wd_mult": 0.0}}
    _, groups = groups_of(gs.OptimizerConfig(), overrides)
    assert [g["param_names"] for g in groups] == [["head.weight"],
                                                   ["embed.weight", "proj.weight", "proj.bias", "norm.weight",
                                                    "norm.bias"]]


def test_group_order_follows_the_overrides_not_the_model_order():
    """Megatron-Core sorts the groups (no-override first, then by sorted override items);
    graphstep used to order them by first appearance, so reversing the model reordered the groups."""
    config = gs.OptimizerConfig(lr=1e-3, decoupled_lr=5e-4, weight_decay=0.1)
    overrides = {**get_standard_config_overrides(config), ParamKey(name="proj.*"): {"lr_mult": 0.5}}
    named = list(Net().named_parameters())
    forward = build_param_groups(named, config, overrides)
    backward = build_param_groups(named[::-1], config, overrides)
    expected = [{"lr_mult": 0.5}, {"lr_mult": 0.5, "wd_mult": 0.0}, {"max_lr": 5e-4}, {"wd_mult": 0.0}]
    assert [g["overrides"] for g in forward] == [g["overrides"] for g in backward] == expected
    assert [g["param_names"] for g in forward] == [["proj.weight"], ["proj.bias"], ["embed.weight", "head.weight"],
                                                   ["norm.weight", "norm.bias"]]
    assert [g["param_names"][::-1] for g in backward] == [g["param_names"] for g in forward]
    # A model with a param that no override selects: its group comes first.
    named.append(("extra", torch.nn.Parameter(torch.zeros(3, 3))))
    assert build_param_groups(named[::-1], config, overrides)[0]["param_names"] == ["extra"]


def test_an_empty_override_gets_a_group_of_its_own_right_after_the_no_override_group():
    """Megatron-Core keys a param's group by its merged override, None when no key matches it: a key with an
    empty override gives its params the key () and so a group of their own, sorted right after the
    no-override group (None first, then the override tuples, () before any other). graphstep merged them
    into the no-override group. Checked against megatron-core 0.16.1 in test_megatron_parity_groups.py."""
    overrides = {ParamKey(name="*.bias"): {}, ParamKey(name="embed.*"): {"wd_mult": 0.5},
                 ParamKey(name="norm.*"): {"lr_mult": 0.5}}
    _, groups = groups_of(gs.OptimizerConfig(lr=1e-3, weight_decay=0.1), overrides)
    assert summary(groups, "overrides", "lr", "weight_decay") == [
        (["proj.weight", "head.weight"], {}, 1e-3, 0.1),  # no key matches them
        (["proj.bias"], {}, 1e-3, 0.1),  # only the empty override matches it
        (["norm.weight", "norm.bias"], {"lr_mult": 0.5}, 1e-3 * 0.5, 0.1),  # {} merged into lr_mult's
        (["embed.weight"], {"wd_mult": 0.5}, 1e-3, 0.1 * 0.5),
    ]
    # Every param under an empty override: one group, as with no overrides at all.
    _, groups = groups_of(gs.OptimizerConfig(), {ParamKey(name="*"): {}})
    assert len(groups) == 1 and len(groups[0]["params"]) == 6


def test_min_lr_none_stays_none_in_the_groups():
    """Megatron-Core's groups carry ``min_lr = config.min_lr`` even when it is None (its
    scheduler reads that as 0); graphstep wrote 0.0 into the group."""
    _, groups = groups_of(gs.OptimizerConfig(lr=1e-3, decoupled_lr=5e-4))
    assert [g["min_lr"] for g in groups] == [None, None, None]
    _, groups = groups_of(gs.OptimizerConfig(lr=1e-3, min_lr=1e-5, decoupled_lr=5e-4, decoupled_min_lr=2e-5))
    assert [g["min_lr"] for g in groups] == [1e-5, 2e-5, 1e-5]


def test_an_override_repeating_the_base_optimizer_is_accepted_and_changes_nothing():
    """Megatron-Core's consistency check refuses ``optimizer`` only when it differs from the
    config's. Repeating it changes nothing, so it does not split a group either."""
    config = gs.OptimizerConfig(optimizer="adam")
    same = {ParamKey(name="proj.*"): {"optimizer": "adam"}, ParamKey(name="head.*"): {"optimizer": "adam",
                                                                                       "lr_mult": 0.5}}
    assert check_config_overrides_consistency(config, same) is True
    _, groups = groups_of(config, same)
    assert summary(groups, "overrides", "lr") == [
        (["embed.weight", "proj.weight", "proj.bias", "norm.weight", "norm.bias"], {}, 1e-3),
        (["head.weight"], {"lr_mult": 0.5}, 1e-3 * 0.5),
    ]
    sgd = gs.OptimizerConfig(optimizer="sgd")
    assert check_config_overrides_consistency(sgd, {ParamKey(name="*"): {"optimizer": "sgd"}}) is True
    with pytest.raises(ValueError, match="optimizer='adam' differs from the config's 'sgd'"):
        check_config_overrides_consistency(sgd, {ParamKey(name="*"): {"optimizer": "adam"}})
    with pytest.raises(ValueError, match="fp16=True differs from the config's False"):
        groups_of(config, {ParamKey(name="*"): {"fp16": True}})
    with pytest.raises(ValueError, match="fp16=0 differs"):  # a bool setting is repeated only by a bool
        groups_of(config, {ParamKey(name="*"): {"fp16": 0}})


def test_empty_overrides_give_one_group_with_the_config_values():
    config = gs.OptimizerConfig(optimizer="adam", lr=2e-3, min_lr=1e-4, weight_decay=0.1, adam_beta1=0.8,
                                adam_beta2=0.95, adam_eps=1e-6)
    _, groups = groups_of(config, {})
    assert len(groups) == 1
    group = dict(groups[0])
    params = group.pop("params")
    assert len(params) == 6 and all(isinstance(p, torch.nn.Parameter) for p in params)
    assert group == {"param_names": ["embed.weight", "proj.weight", "proj.bias", "norm.weight", "norm.bias",
                                     "head.weight"],
                     "lr": 2e-3, "max_lr": 2e-3, "min_lr": 1e-4, "lr_mult": 1.0, "wd_mult": 1.0,
                     "weight_decay": 0.1, "start_wd": 0.1, "end_wd": 0.1, "eps": 1e-6, "betas": (0.8, 0.95),
                     "overrides": {}}


def test_sgd_groups_carry_momentum_not_betas():
    config = gs.OptimizerConfig(optimizer="sgd", sgd_momentum=0.5, sgd_nesterov=True)
    _, groups = groups_of(config, {})
    assert groups[0]["momentum"] == 0.5 and groups[0]["nesterov"] is True and "betas" not in groups[0]


def test_weight_decay_ramp_overrides_start_the_group_at_start_wd():
    overrides = {ParamKey(name="proj.weight"): {"start_wd": 0.02, "end_wd": 0.2, "wd_mult": 0.5}}
    by_name, _ = groups_of(gs.OptimizerConfig(weight_decay=0.1), overrides)
    group = by_name["proj.weight"]
    assert (group["weight_decay"], group["start_wd"], group["end_wd"]) == (0.02 * 0.5, 0.02, 0.2)


def test_conflicting_overrides_name_the_param_and_both_keys():
    overrides = {ParamKey(name="proj.*"): {"max_lr": 1.0}, ParamKey(attr="is_embedding_or_output_parameter"):
                 {"max_lr": 2.0}, ParamKey(name="*.weight"): {"max_lr": 3.0}}
    with pytest.raises(ValueError, match=r"param 'embed.weight': ParamKey\(attr=\['is_embedding_or_output_parameter'\]"
                                         r"\) sets max_lr=2.0 but ParamKey\(name=\['\*.weight'\]\) sets max_lr=3.0"):
        groups_of(gs.OptimizerConfig(), overrides)


# ---- standard and MuP overrides ----------------------------------------------------------------------

def test_standard_overrides_drop_weight_decay_on_biases_and_1d():
    config = gs.OptimizerConfig(lr=1e-3, weight_decay=0.1, adam_eps=1e-8)
    _, groups = groups_of(config)
    assert summary(groups, "lr", "min_lr", "weight_decay", "wd_mult", "eps") == [
        (["embed.weight", "proj.weight", "head.weight"], 1e-3, None, 0.1, 1.0, 1e-8),
        (["proj.bias", "norm.weight", "norm.bias"], 1e-3, None, 0.0, 0.0, 1e-8),
    ]
    # The glob alone catches a 2-D "bias"; the predicate alone a 1-D param of any name.
    key = next(iter(get_standard_config_overrides(config)))
    assert key.matches(torch.nn.Parameter(torch.zeros(2, 2)), "odd.bias")
    assert key.matches(torch.nn.Parameter(torch.zeros(3)), "scale")
    assert not key.matches(torch.nn.Parameter(torch.zeros(2, 2)), "w")


class QKNormNet(torch.nn.Module):
    """An attention block named as Megatron-Core's: linear_qkv (with bias), q_layernorm and k_layernorm (1-D
    weight and bias each), linear_proj, and a final layernorm."""

    def __init__(self):
        super().__init__()
        self.self_attention = torch.nn.Module()
        self.self_attention.linear_qkv = torch.nn.Linear(8, 24)
        self.self_attention.q_layernorm = torch.nn.LayerNorm(4)
        self.self_attention.k_layernorm = torch.nn.LayerNorm(4)
        self.self_attention.linear_proj = torch.nn.Linear(8, 8, bias=False)
        self.final_layernorm = torch.nn.LayerNorm(8)


@pytest.mark.parametrize("apply_wd_to_qk_layernorm", [False, True])
def test_standard_overrides_apply_wd_to_qk_layernorm(apply_wd_to_qk_layernorm):
    """Megatron-Core's ``apply_wd_to_qk_layernorm`` (Qwen3-Next's rule): True keeps weight decay on the
    params of q_layernorm / k_layernorm modules, biases included, though they are 1-D; other 1-D params
    and biases still get none. graphstep ignored the field."""
    config = gs.OptimizerConfig(lr=1e-3, weight_decay=0.1, apply_wd_to_qk_layernorm=apply_wd_to_qk_layernorm)
    groups = build_param_groups(list(QKNormNet().named_parameters()), config)
    qk_norms = ["self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
                "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias"]
    decayed = ["self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"]
    not_decayed = ["self_attention.linear_qkv.bias", "final_layernorm.weight", "final_layernorm.bias"]
    if apply_wd_to_qk_layernorm:
        decayed = decayed[:1] + qk_norms + decayed[1:]  # model order
    else:
        not_decayed = not_decayed[:1] + qk_norms + not_decayed[1:]
    assert summary(groups, "wd_mult", "weight_decay") == [(decayed, 1.0, 0.1), (not_decayed, 0.0, 0.0)]


@pytest.mark.parametrize("decoupled_min_lr, min_lr, expected_floor", [(1e-5, 2e-5, 1e-5), (None, 2e-5, 2e-5),
                                                                      (None, None, None)])
def test_decoupled_lr_for_embedding_and_output(decoupled_min_lr, min_lr, expected_floor):
    config = gs.OptimizerConfig(lr=1e-3, min_lr=min_lr, decoupled_lr=5e-4, decoupled_min_lr=decoupled_min_lr,
                                weight_decay=0.1)
    _, groups = groups_of(config)
    assert summary(groups, "lr", "max_lr", "min_lr", "weight_decay") == [
        (["proj.weight"], 1e-3, 1e-3, min_lr, 0.1),
        (["embed.weight", "head.weight"], 5e-4, 5e-4, expected_floor, 0.1),
        (["proj.bias", "norm.weight", "norm.bias"], 1e-3, 1e-3, min_lr, 0.0),
    ]


def test_mup_adam_scales_matrix_like_lr_and_eps():
    config = gs.OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, adam_eps=1e-8, weight_decay=0.1)
    m = 4.0
    overrides = {**get_standard_config_overrides(config), **get_mup_config_overrides(config, m)}
    _, groups = groups_of(config, overrides)
    assert summary(groups, "lr", "min_lr", "eps", "weight_decay") == [
        (["embed.weight"], 1e-3, 1e-4, 1e-8, 0.1),  # vector-like: embedding-class
        (["proj.weight", "head.weight"], 1e-3 / m, 1e-4 / m, 1e-8 / m, 0.1),  # matrix-like: hidden and output
        (["proj.bias", "norm.weight", "norm.bias"], 1e-3, 1e-4, 1e-8, 0.0),  # vector-like: 1-D
    ]


def test_mup_sgd_scales_vector_like_lr_but_keeps_decoupled_params():
    config = gs.OptimizerConfig(optimizer="sgd", lr=1e-3, decoupled_lr=3e-4, weight_decay=0.1)
    m = 2.0
    overrides = {**get_standard_config_overrides(config), **get_mup_config_overrides(config, m)}
    _, groups = groups_of(config, overrides)
    assert summary(groups, "lr", "weight_decay") == [
        (["proj.weight"], 1e-3, 0.1),  # hidden matrix: unchanged under SGD
        (["embed.weight", "head.weight"], 3e-4, 0.1),  # decoupled values win over MuP
        (["proj.bias", "norm.weight", "norm.bias"], 1e-3 * m, 0.0),
    ]


def test_mup_other_optimizers_scale_matrix_like_lr_without_eps():
    config = gs.OptimizerConfig(lr=1e-3)
    (key, override), = get_mup_config_overrides(config, 8.0, optimizer_type="lion").items()
    assert override == {"max_lr": 1e-3 / 8.0}
    assert key.matches(torch.nn.Parameter(torch.zeros(4, 4)), "w")
    assert not key.matches(torch.nn.Parameter(torch.zeros(4)), "b")
    assert list(get_mup_config_overrides(config, 2.0, optimizer_type="AdamW").values()) == \
        [{"max_lr": 1e-3 / 2.0, "eps": config.adam.eps / 2.0}]


def _param(shape, **attrs):
    param = torch.nn.Parameter(torch.zeros(shape))
    for attr, value in attrs.items():
        setattr(param, attr, value)
    return param


OUTPUT = dict(is_embedding_or_output_parameter=True)
EMBEDDING = dict(is_embedding_parameter=True, is_embedding_or_output_parameter=True)
# (name, shape, attrs, optimizer, decoupled) -> (lr factor, eps factor) at width multiplier m = 4;
# "decoupled" means the param keeps decoupled_lr (factor None). Megatron-Core's get_mup_config_overrides.
MUP_CLASSES = [
    ("output_layer.weight", (6, 4), OUTPUT, "adam", False, 1 / 4, 1 / 4),  # output: a hidden matrix
    ("output_layer.weight", (6, 4), OUTPUT, "lion", False, 1 / 4, 1),
    ("output_layer.weight", (6, 4), OUTPUT, "sgd", False, 1, 1),
    ("output_layer.weight", (6, 4), OUTPUT, "adam", True, None, 1 / 4),  # decoupled lr, but eps / m
    ("output_layer.weight", (6, 4), OUTPUT, "lion", True, None, 1),
    ("output_layer.weight", (6, 4), OUTPUT, "sgd", True, None, 1),
    ("embedding.word_embeddings.weight", (6, 4), {}, "adam", False, 1, 1),  # by name: embedding-class
    ("embedding.word_embeddings.weight", (6, 4), {}, "sgd", False, 4, 1),  # SGD: embedding-class lr x m
    ("Model.Embedding_Table", (6, 4), {}, "sgd", False, 4, 1),  # the name test ignores case
    ("embed.weight", (6, 4), EMBEDDING, "sgd", False, 4, 1),
    ("embed.weight", (6, 4), EMBEDDING, "sgd", True, None, 1),
    ("embed.weight", (6, 4), EMBEDDING, "adam", False, 1, 1),
    ("embedding.weight", (6, 4), dict(is_embedding_parameter=False), "adam", False, 1 / 4, 1 / 4),  # attr decides
    ("tied.weight", (6, 4), dict(shared_embedding=True, is_embedding_parameter=False), "adam", False, 1, 1),
    ("tied.weight", (6, 4), dict(shared_embedding=True), "sgd", False, 4, 1),
    ("layers.0.mlp.weight", (6, 4), {}, "adam", True, 1 / 4, 1 / 4),
    ("layers.0.mlp.weight", (6, 4), {}, "sgd", False, 1, 1),
    ("layers.0.norm.weight", (4,), {}, "sgd", True, 4, 1),
    ("layers.0.norm.weight", (4,), {}, "adam", False, 1, 1),
    # Muon: the matrices Muon updates itself are left out; what its scalar optimizer takes gets lr / m.
    ("layers.0.mlp.weight", (6, 4), {}, "muon", False, 1, 1),
    ("layers.0.mlp.weight", (6, 4), dict(use_muon=False), "muon", False, 1 / 4, 1),
    ("output_layer.weight", (6, 4), OUTPUT, "muon", False, 1 / 4, 1),
    ("layers.0.norm.weight", (4,), {}, "muon", False, 1, 1),
]


@pytest.mark.parametrize("name, shape, attrs, optimizer, decoupled, lr_factor, eps_factor", MUP_CLASSES)
def test_mup_param_classes_follow_megatron_core(name, shape, attrs, optimizer, decoupled, lr_factor, eps_factor):
    """graphstep treated ``is_embedding_or_output_parameter`` as vector-like (so an output
    layer kept the base lr and eps) and never looked at ``is_embedding_parameter``, ``shared_embedding``
    or the name (so SGD left an embedding's lr alone)."""
    config = gs.OptimizerConfig(optimizer="sgd" if optimizer == "sgd" else "adam", lr=1e-2, min_lr=1e-3,
                                adam_eps=1e-6, decoupled_lr=3e-3 if decoupled else None)
    overrides = {**get_standard_config_overrides(config), **get_mup_config_overrides(config, 4.0, optimizer)}
    groups = build_param_groups([(name, _param(shape, **attrs))], config, overrides)
    (group,) = [g for g in groups if g["params"]]
    expected_lr = 3e-3 if lr_factor is None else 1e-2 * lr_factor
    assert group["lr"] == pytest.approx(expected_lr, rel=1e-12)
    assert group["eps"] == pytest.approx(1e-6 * eps_factor, rel=1e-12)


def test_megatron_cores_own_mup_figures():
    """The values Megatron-Core's unit test (test_optimizer_package_mup_overrides...) asserts, m = 2 / 3."""
    adam = gs.OptimizerConfig(optimizer="adam", lr=0.1, min_lr=0.01, decoupled_lr=0.2, decoupled_min_lr=0.02,
                              adam_eps=1e-6)
    overrides = get_mup_config_overrides(adam, 2.0, "adam")
    assert {"max_lr": 0.05, "min_lr": 0.005} in overrides.values() and {"eps": 5e-7} in overrides.values()
    hidden, output = _param((2, 2)), _param((2, 2), **OUTPUT)
    hidden_hits = [o for k, o in overrides.items() if k.matches(hidden, "decoder.layers.0.mlp.weight")]
    output_hits = [o for k, o in overrides.items() if k.matches(output, "output_layer.weight")]
    assert {"max_lr": 0.05, "min_lr": 0.005} in hidden_hits and {"eps": 5e-7} in hidden_hits
    assert output_hits == [{"eps": 5e-7}]
    sgd = get_mup_config_overrides(gs.OptimizerConfig(optimizer="sgd", lr=0.1, min_lr=0.01), 3.0, "sgd")
    assert list(sgd.values()) == [{"max_lr": 0.30000000000000004, "min_lr": 0.03}]
    assert next(iter(sgd)).matches(_param((2,)), "norm.weight")


def test_mup_with_width_one_is_empty():
    for rule in ("adam", "sgd", "muon"):
        assert get_mup_config_overrides(gs.OptimizerConfig(), 1.0, rule) == {}


# ---- bad input ---------------------------------------------------------------------------------------

def _groups_with(override):
    return groups_of(gs.OptimizerConfig(), {ParamKey(name="proj.*"): override})


BAD = [
    (lambda: ParamKey(), ValueError, "at least one name glob"),
    (lambda: ParamKey(name=3), TypeError, r"ParamKey.name: 3 is a int"),
    (lambda: ParamKey(name=["*.w", None]), TypeError, r"ParamKey.name: None"),
    (lambda: ParamKey(name=""), ValueError, "empty name glob"),
    (lambda: ParamKey(attr=""), ValueError, "empty name glob or attribute"),
    (lambda: ParamKey(predicate=lambda p, n: True), TypeError, "ParamKey.predicate"),
    (lambda: NamedPredicate("", lambda p, n: True), TypeError, "NamedPredicate: name=''"),
    (lambda: NamedPredicate("x", 3), TypeError, "NamedPredicate 'x': fn=3 is not callable"),
    (lambda: _groups_with({"lr": 1.0}), ValueError, r"ParamKey\(name=\['proj.\*'\]\): 'lr' .* use max_lr"),
    (lambda: _groups_with({"optimizer": "sgd"}), ValueError,
     r"ParamKey\(name=\['proj.\*'\]\): optimizer='sgd' differs .* 'optimizer' is a setting of the whole optimizer"),
    (lambda: _groups_with({"betas": (0.9, 0.9)}), ValueError, r"ParamKey\(name=\['proj.\*'\]\): unknown key 'betas'"),
    (lambda: _groups_with({"max_lr": -1.0}), ValueError, r"ParamKey\(name=\['proj.\*'\]\): max_lr=-1.0 must be >= 0"),
    (lambda: _groups_with({"eps": 0.0}), ValueError, r"eps=0.0 must be at least 2\*\*-126"),
    (lambda: _groups_with({"wd_mult": "x"}), ValueError, "wd_mult='x' must be a finite number"),
    (lambda: _groups_with({"lr_mult": float("nan")}), ValueError, "lr_mult=nan must be a finite number"),
    (lambda: _groups_with({"min_lr": True}), ValueError, "min_lr=True must be a finite number"),
    (lambda: _groups_with({"max_lr": 1e-5, "min_lr": 1e-4}), ValueError,
     "param 'proj.weight': min_lr=0.0001 exceeds max_lr=1e-05"),
    (lambda: _groups_with(0.5), TypeError, r"ParamKey\(name=\['proj.\*'\]\): expected a dict"),
    (lambda: groups_of(gs.OptimizerConfig(), {"*.bias": {"wd_mult": 0.0}}), TypeError,
     "key '\\*.bias' is a str, expected a ParamKey"),
    (lambda: groups_of(gs.OptimizerConfig(), [(ParamKey(name="*"), {})]), TypeError,
     "config_overrides: expected a dict"),
    (lambda: get_mup_config_overrides(gs.OptimizerConfig(), 0.0), ValueError, "mup_width_mult=0.0"),
    (lambda: get_mup_config_overrides(gs.OptimizerConfig(), -2), ValueError, "mup_width_mult=-2"),
    (lambda: get_mup_config_overrides(gs.OptimizerConfig(), 2.0, optimizer_type=3), TypeError, "optimizer_type=3"),
]


@pytest.mark.parametrize("make, error, message", BAD)
def test_bad_override_input_names_what_is_wrong(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_bad_param_lists_name_the_param():
    config = gs.OptimizerConfig()
    w = torch.nn.Parameter(torch.zeros(2, 2))
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    with pytest.raises(ValueError, match="param 'f' does not require grad"):
        build_param_groups([("f", frozen)], config, {})
    with pytest.raises(ValueError, match="param name 'w' appears twice"):
        build_param_groups([("w", w), ("w", torch.nn.Parameter(torch.zeros(2)))], config, {})
    with pytest.raises(ValueError, match="param 'tied' is the same tensor as 'w'"):
        build_param_groups([("w", w), ("tied", w)], config, {})
    with pytest.raises(TypeError, match=r"expected \(name, Parameter\) pairs"):
        build_param_groups([w], config, {})


def test_consistency_check_accepts_good_overrides():
    config = gs.OptimizerConfig(decoupled_lr=1e-4)
    assert check_config_overrides_consistency(config, get_standard_config_overrides(config)) is True
    assert check_config_overrides_consistency(config, get_mup_config_overrides(config, 2.0)) is True
    assert check_config_overrides_consistency(config, {}) is True
    assert check_config_overrides_consistency(config, None) is True


def test_get_optimizer_checks_overrides_and_uses_them():
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="eager"), Net(), {ParamKey(name="head.*"): {"lr_mult": 0.5}})
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-3 * 0.5]
    with pytest.raises(ValueError, match="unknown key 'betas'"):
        gs.get_optimizer(gs.OptimizerConfig(), Net(), {ParamKey(name="*"): {"betas": (0.9, 0.9)}})
