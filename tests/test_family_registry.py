"""The optimizer-family registry (graphstep/families/): every rule about a family lives in its module, no
other library module names a family, and an unknown family is an error everywhere, never SGD's rules
(issue 28, item 1)."""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import graphstep as gs
from graphstep import families
from graphstep.plan.overrides import build_param_groups, get_mup_config_overrides
from graphstep.plan.routing import _family_group, build_family_param_groups
from graphstep.families import FAMILIES, HyperField, StateSpec, adam, get_family, muon
from graphstep.state.hyperparams import FIELDS, GROUP_FIELDS, group_values

ROOT = Path(__file__).resolve().parents[1]
NAMES = frozenset(FAMILIES)

# Library files allowed to hold a family name as a string literal, with how many, and why. Keep it short.
ALLOWED = {
    # OptimizerConfig.optimizer defaults to "adam": a dataclass default is the field's documented value
    # (test_config_defaults_name_registered_families checks it); its field "muon" (each family's options are
    # the field named after it) is rewritten where "adamw" becomes "adam" in MuonOptions.scalar_optimizer.
    "graphstep/config/__init__.py": 2,
}


def family_literals(path: Path) -> list:
    """(line, value) of every string constant in ``path`` that is a family name (any case)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in NAMES]


def test_no_family_name_literal_outside_the_families_package():
    offending = {}
    for path in sorted((ROOT / "graphstep").rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[1] in ("families", "app"):
            continue
        found = family_literals(path)
        if len(found) > ALLOWED.get(relative.as_posix(), 0):
            offending[relative.as_posix()] = found
    assert not offending, f"family names outside graphstep/families/ (ask the registry instead): {offending}"


def test_the_scan_sees_a_family_literal():
    # The scan itself must fire: this very file compares with one.
    assert any(value == "muon" for _, value in family_literals(Path(__file__)))


def test_config_defaults_name_registered_families():
    config = gs.OptimizerConfig()
    assert config.optimizer in FAMILIES
    assert config.muon.scalar_optimizer in muon.SCALAR_FAMILIES and muon.SCALAR_FAMILIES[0] in FAMILIES


# ---- derived from the registered families -----------------------------------------------------------------

def test_live_table_columns_are_derived_in_their_old_order():
    # A family registered later appends its new columns (AdEMAMix: beta3, alpha); the old ones keep their place.
    assert GROUP_FIELDS[:6] == ("lr", "weight_decay", "beta1", "beta2", "eps", "momentum")
    assert FIELDS == GROUP_FIELDS + ("clip_grad", "grad_norm_skip_threshold")
    for family in FAMILIES.values():
        assert {column for _, column in family.hyperparameters} <= set(GROUP_FIELDS)


def test_group_values_read_each_column_where_its_family_puts_it():
    group = {"lr": 0.1, "weight_decay": 0.2, "betas": (0.3, 0.4), "eps": 0.5}
    later = (0.0,) * (len(GROUP_FIELDS) - 6)  # the columns of families registered later: not these groups'
    assert group_values(group) == (0.1, 0.2, 0.3, 0.4, 0.5, 0.0) + later
    assert group_values({"lr": 0.1, "momentum": 0.9, "nesterov": True}) == (0.1, 0.0, 0.0, 0.0, 0.0, 0.9) + later


# The defaults torch.optim sees: what engine.py's _defaults returned, key order included.
TORCH_DEFAULTS = {
    "adam": {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-8, "betas": (0.9, 0.999)},
    "sgd": {"lr": 1e-3, "weight_decay": 0.01, "momentum": 0.9, "nesterov": False},
    "lion": {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.95, 0.98)},
    "muon": {"lr": 1e-3, "weight_decay": 0.01, "momentum": 0.95},
    "ademamix": {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-8, "betas": (0.9, 0.999), "beta3": 0.9999, "alpha": 5.0},
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_torch_defaults_per_family(name):
    defaults = families.torch_defaults(gs.OptimizerConfig(optimizer=name))
    assert list(defaults.items()) == list(TORCH_DEFAULTS[name].items())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_one_cycle_lr_cycles_a_key_the_family_reads(name):
    """torch's OneCycleLR cycles ``betas`` when the defaults have it, else ``momentum``: in the groups of
    the config's family, the key it writes must be one the kernel reads. (With Muon, its scalar optimizer's
    groups get a ``momentum`` too, which they ignore: torch has one defaults dict per optimizer.)"""
    config = gs.OptimizerConfig(optimizer=name)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    groups = build_family_param_groups(list(model.named_parameters()), config, model_chunks=model)
    opt = torch.optim.Optimizer(groups, families.torch_defaults(config))
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    cycled = "betas" if "betas" in opt.defaults else "momentum"
    own = [group for group in opt.param_groups if group.get("optimizer", name) == name]
    assert own
    for group in own:
        assert cycled in {field.key for field in get_family(name).fields}, (name, cycled)
        assert "max_momentum" in group


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_build_param_groups_gives_the_configs_family_its_own_keys(name):
    """Before the registry, a config naming Lion or Muon got SGD's momentum/nesterov in every group."""
    config = gs.OptimizerConfig(optimizer=name, sgd_momentum=0.5)
    (group,) = build_param_groups([("w", torch.nn.Parameter(torch.zeros(3, 3)))], config, {})
    own = get_family(name).group_defaults(config)
    assert {k: group[k] for k in own} == own
    assert not set(families.group_keys(config)) - set(own) & set(group)


def test_state_specs_carry_their_invariants():
    assert families.state_spec("exp_avg_sq").nonnegative
    assert not families.state_spec("exp_avg").nonnegative
    assert not families.state_spec("momentum_buffer").nonnegative
    with pytest.raises(ValueError, match="'m3'"):
        families.state_spec("m3")


# ---- an unknown family is an error, never SGD's rules -----------------------------------------------------

def test_get_family_names_the_unknown_one():
    with pytest.raises(ValueError, match="optimizer='adafactor': must be one of 'adam', 'sgd', 'lion', 'muon'"):
        get_family("adafactor")
    assert get_family("adamw", aliases=True) is FAMILIES["adam"]
    with pytest.raises(ValueError, match="'adamw'"):
        get_family("adamw")


def test_an_override_naming_an_unknown_optimizer_is_refused():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="optimizer='adafactor' must be one of"):
        build_family_param_groups(list(model.named_parameters()), gs.OptimizerConfig(),
                                  {gs.ParamKey(name="*"): {"optimizer": "adafactor"}})


def test_routing_an_unknown_family_does_not_fall_through_to_sgd():
    config = gs.OptimizerConfig()
    (group,) = build_param_groups([("w", torch.nn.Parameter(torch.zeros(2, 2)))], config, {})
    with pytest.raises(ValueError, match="'adafactor'"):
        _family_group(config, group, "adafactor")


def test_mup_refuses_an_unknown_family_instead_of_guessing_by_substring():
    """Before: a name other than "sgd" without "adam" in it silently got Lion's rule (lr / m), one with
    "adam" in it (e.g. "adamax") Adam's."""
    for name in ("adafactor", "rmsprop"):
        with pytest.raises(ValueError, match=f"optimizer_type='{name}'"):
            get_mup_config_overrides(gs.OptimizerConfig(), 2.0, name)


def test_a_family_missing_a_rule_is_refused_naming_it():
    fake = dataclasses.replace(FAMILIES["adam"], name="fake", aliases=(), torch_defaults=None)
    with pytest.raises(ValueError, match="family 'fake' declares no 'torch_defaults' rule"):
        families.check_registry([*FAMILIES.values(), fake])


def test_families_sharing_a_column_or_a_state_must_agree():
    other_key = dataclasses.replace(FAMILIES["lion"], name="fake",
                                    fields=(families.LR, HyperField("beta1", "lion_betas", index=0)))
    with pytest.raises(ValueError, match="'fake' reads column 'beta1'"):
        families.check_registry([*FAMILIES.values(), other_key])
    signed = dataclasses.replace(FAMILIES["lion"], name="fake", states=(StateSpec("exp_avg_sq"),))
    with pytest.raises(ValueError, match="'fake' declares state 'exp_avg_sq' with nonnegative=False"):
        families.check_registry([*FAMILIES.values(), signed])
    with pytest.raises(ValueError, match="name or an alias is taken"):
        families.check_registry([*FAMILIES.values(), dataclasses.replace(adam.FAMILY, name="fake")])



def test_a_family_on_the_configured_kernels_names_the_entry_points_it_calls():
    # The kernel contract names no family: each family says what it calls, each implementation what it offers.
    with pytest.raises(ValueError, match="'fake': declare the entry points of the configured kernels"):
        dataclasses.replace(FAMILIES["adam"], name="fake", aliases=(), entry_points=())
    with pytest.raises(ValueError, match="'fake': declare the entry points"):
        dataclasses.replace(FAMILIES["lion"], name="fake", entry_points=("sgd",))

MUON_ONLY = {"takes", "scalar_family", "views", "check", "splits_fused_qkv", "updates_split_matrices_by_slice"}


def test_what_only_a_whole_matrix_family_needs_is_one_record_it_declares():
    """Muon's routing (which params it takes, who gets the rest), whole-matrix views, build check and its answers
    about fused QKV and split matrices are one ``MatrixRules``; the other families declare none and get the
    defaults, instead of six flags each."""
    assert not {field.name for field in dataclasses.fields(families.Family)} & MUON_ONLY
    assert [family.name for family in FAMILIES.values() if family.matrices is not None] == ["muon"]
    config = gs.OptimizerConfig(optimizer="muon")
    for family in FAMILIES.values():
        if family.matrices is None:
            assert family.views is families.flat_views and family.check is None and not family.batch_by_shape
            assert not family.splits_fused_qkv(config) and not family.updates_split_matrices_by_slice(config)
    matrices = FAMILIES["muon"]
    assert matrices.batch_by_shape and matrices.views is matrices.matrices.views and matrices.check is not None
    assert matrices.splits_fused_qkv(config) and not matrices.splits_fused_qkv(config.replace(muon_split_qkv=False))
    assert matrices.updates_split_matrices_by_slice(config)
    assert not matrices.updates_split_matrices_by_slice(config.replace(muon_tp_mode="duplicated"))


def test_offload_refusal_lists_the_families_that_support_it():
    with pytest.raises(ValueError, match="runs Adam and SGD updates on the host, not optimizer='lion': use "
                                         "optimizer='adam' or 'sgd'"):
        gs.OptimizerConfig(optimizer_cpu_offload=True, optimizer="lion")
