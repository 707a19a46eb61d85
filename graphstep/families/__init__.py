"""Optimizer families: one module per update rule, and the registry every other module asks.

Each family module (``adam.py``, ``sgd.py``, ``lion.py``, ``muon.py``, ``ademamix.py``) fills in one ``Family``
(graphstep/families/base.py) with everything graphstep knows about its rule: name and aliases, options and their
validation, param-group keys and torch defaults, MuP rule, hyperparameter fields (the live table's columns,
``hyper_columns``), state and kernel call. Which hyperparameters are live device tensors and which are baked
floats is the kernel module's ``LIVE_FIELDS``.

Adding a family: its kernel, a module here, its entry in ``_MODULES``, and, for options of its own, one
``OptimizerConfig`` field named after it. Nothing else changes: an unknown family name is an error everywhere
(``get_family``), and no other module names a family (tests/test_family_registry.py).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from . import adam, ademamix, lion, muon, sgd
from .base import (LR, WEIGHT_DECAY, Family, GroupViews, HyperField, MatrixRules, MupRule, StateSpec, StepScalars,
                   ViewSources, flat_views)

__all__ = ["FAMILIES", "Family", "GroupViews", "HyperField", "MatrixRules", "MupRule", "StateSpec", "StepScalars",
           "ViewSources", "check_registry", "families_of", "family_name", "flat_views", "get_family", "group_keys",
           "hyper_columns", "state_names", "state_spec", "torch_defaults"]

# Registration order is the live table's column order (hyper_columns): keep new families at the end.
_MODULES = (adam, sgd, lion, muon, ademamix)

_RULES = ("states", "validate", "group_defaults", "torch_defaults", "mup", "call", "views")


def check_registry(families: Sequence[Family]) -> dict[str, Family]:
    """``families`` by name, refused (naming the family and the rule) when one lacks a rule or two disagree
    on a shared column, state name or name."""
    registry: dict[str, Family] = {}
    aliases: set = set()
    for family in families:
        if not isinstance(family, Family):
            raise TypeError(f"optimizer family {family!r}: must be a graphstep.families.Family")
        for rule in _RULES:
            if getattr(family, rule, None) is None:
                raise ValueError(f"optimizer family {family.name!r} declares no {rule!r} rule; every family "
                                 "states its own (see graphstep/families/adam.py): none is borrowed from another")
        if not isinstance(family.mup, MupRule):
            raise ValueError(f"optimizer family {family.name!r}: mup must be a MupRule, got {family.mup!r}")
        if LR not in family.fields:
            raise ValueError(f"optimizer family {family.name!r}: its fields must include lr (every group has one)")
        names = {family.name, *family.aliases}
        if family.name in registry or names & aliases or names & set(registry):
            raise ValueError(f"optimizer family {family.name!r}: its name or an alias is taken by another family")
        registry[family.name] = family
        aliases |= set(family.aliases)
    _columns(registry.values())
    _state_specs(registry.values())
    return registry


def _columns(families) -> tuple[HyperField, ...]:
    columns: dict[str, HyperField] = {LR.column: LR, WEIGHT_DECAY.column: WEIGHT_DECAY}
    for family in families:
        for field in family.fields:
            seen = columns.setdefault(field.column, field)
            if seen != field:
                raise ValueError(f"optimizer family {family.name!r} reads column {field.column!r} from "
                                 f"{field}, another family from {seen}: one column, one place in a group")
    return tuple(columns.values())


def _state_specs(families) -> dict[str, StateSpec]:
    specs: dict[str, StateSpec] = {}
    for family in families:
        for spec in family.states:
            seen = specs.setdefault(spec.name, spec)
            if seen.nonnegative != spec.nonnegative:
                raise ValueError(f"optimizer family {family.name!r} declares state {spec.name!r} with "
                                 f"nonnegative={spec.nonnegative}, another family with {seen.nonnegative}: "
                                 "families sharing a state buffer share its invariants")
    return specs


FAMILIES: Mapping[str, Family] = check_registry([module.FAMILY for module in _MODULES])
_COLUMNS = _columns(FAMILIES.values())
_STATE_SPECS = _state_specs(FAMILIES.values())


def get_family(name: str, *, aliases: bool = False) -> Family:
    """The family named ``name`` (``aliases``: or one of its aliases, such as "adamw"); an unknown name
    raises ValueError listing the registered ones."""
    family = FAMILIES.get(name)
    if family is None and aliases:
        family = next((f for f in FAMILIES.values() if name in f.aliases), None)
    if family is None:
        known = list(FAMILIES) + ([a for f in FAMILIES.values() for a in f.aliases] if aliases else [])
        raise ValueError(f"optimizer={name!r}: must be one of {', '.join(map(repr, known))}")
    return family


# Names ``OptimizerConfig.optimizer`` (and ``MuonOptions.scalar_optimizer``) and an override's ``optimizer`` key accept
# beside the families' own, each standing for a family under one setting of the config: spelling ->
# (family, config field, its value, what the spelling means). They are normalised where they are read, so a
# config, a param group and a checkpoint only ever carry the family's own name.
_SPELLINGS = {
    # graphstep's "adam" decouples weight decay by default (decoupled_weight_decay=True): it is torch's AdamW.
    "adamw": (adam.NAME, "decoupled_weight_decay", True, "Adam with decoupled weight decay (torch's AdamW)"),
}


_IMPLYING = {
    # Megatron-LM's --optimizer for Muon under its layer-wise distributed optimizer.
    "dist_muon": (muon.NAME, "use_layer_wise_distributed_optimizer", True),
}


def implied_by(name) -> Optional[tuple[str, str, Any]]:
    """(family, setting, value) for a spelling of ``_IMPLYING`` ("dist_muon"), which stands for that family with
    that setting switched on; None for any other value."""
    return _IMPLYING.get(name) if isinstance(name, str) else None


def family_name(name, config, field: str = "optimizer"):
    """``name`` as a family's own name: a spelling of ``_SPELLINGS`` ("adamw") becomes its family's name,
    refused (ValueError naming ``field``) when ``config`` contradicts the setting the spelling stands for;
    any other value comes back as given, for the caller's own check."""
    spelling = _SPELLINGS.get(name) if isinstance(name, str) else None
    if spelling is None:
        return name
    family, setting, value, meaning = spelling
    actual = getattr(config, setting)
    if actual != value:
        raise ValueError(f"{field}={name!r} is {meaning}, graphstep's {family!r} with {setting}={value!r}, which "
                         f"{setting}={actual!r} contradicts: drop {setting}={actual!r}, or use "
                         f"{field}={family!r} with it")
    return family


def families_of(param_groups: Sequence[dict], default: str) -> tuple[Family, ...]:
    """Per param group, its family: the group's ``optimizer`` key, else ``default``."""
    return tuple(get_family(group.get("optimizer", default)) for group in param_groups)


def state_names(families: Sequence[Family], config) -> tuple[str, ...]:
    """Every state buffer some group's family keeps, in first-use order."""
    names: list[str] = []
    for family in families:
        names += [n for n in family.state_names(config) if n not in names]
    return tuple(names)


def state_spec(name: str) -> StateSpec:
    """The declaration of state buffer ``name`` (its invariants); an undeclared name raises."""
    try:
        return _STATE_SPECS[name]
    except KeyError:
        raise ValueError(f"optimizer state {name!r} is declared by no registered family (declared: "
                         f"{', '.join(map(repr, _STATE_SPECS))})") from None


def hyper_columns() -> tuple[HyperField, ...]:
    """The live table's per-group columns: lr, weight_decay, then each family's new fields in
    registration order."""
    return _COLUMNS


def group_keys(config) -> tuple[str, ...]:
    """Every key some family puts into its groups (``group_defaults``), in registration order: what a group
    sheds when routing gives it to another family."""
    keys: list[str] = []
    for family in FAMILIES.values():
        keys += [k for k in family.group_defaults(config) if k not in keys]
    return tuple(keys)


def torch_defaults(config) -> dict:
    """``torch.optim.Optimizer.defaults`` for ``config``: lr, weight_decay, then what the config's family
    adds (``betas`` or ``momentum``: what torch's OneCycleLR cycles)."""
    family = get_family(config.optimizer)
    return {"lr": config.lr, "weight_decay": config.weight_decay, **family.torch_defaults(config)}
