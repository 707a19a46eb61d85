"""Per-parameter overrides (Megatron-Core's ``ParamKey`` → ``ParamGroupOverride``) and param groups.

A ``ParamKey`` selects params by name glob, by a truthy attribute, or by a named predicate (any listed
item matching is a match). Every override whose key matches a param is merged into one override for it;
two that set one key to different values are an error. Params with equal merged overrides share a param
group, as in Megatron-Core's ``_get_param_groups`` (megatron/core/optimizer/__init__.py), whose order the
groups follow: first the params no key matches, then the others sorted by their sorted (key, value) pairs,
so params matched only by empty overrides (``{ParamKey(name="*.bias"): {}}``) come second, in a group of
their own. The order of groups depends on the overrides only, never on the order of the model's params.
``build_param_groups`` turns that into the ``param_groups`` the engine (and torch's LR schedulers) use.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypedDict, Union

import torch

from ..config.megatron import held_names, held_value
from ..families import get_family
from ..families import muon as muon_family
from ..families.base import MIN_EPS


@dataclass(frozen=True)
class NamedPredicate:
    """A predicate ``fn(param, name) -> bool`` that compares and hashes by its name."""

    name: str
    fn: Callable[[torch.nn.Parameter, str], bool]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"NamedPredicate: name={self.name!r} must be a non-empty string (it is the identity "
                            "checkpoints match param groups by)")
        if not callable(self.fn):
            raise TypeError(f"NamedPredicate '{self.name}': fn={self.fn!r} is not callable; give fn(param, name)")

    def __eq__(self, other) -> bool:
        return isinstance(other, NamedPredicate) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("NamedPredicate", self.name))

    def __call__(self, param: torch.nn.Parameter, name: str) -> bool:
        return bool(self.fn(param, name))


def _as_tuple(value, what: str, kind) -> tuple:
    if isinstance(value, (str, NamedPredicate)):
        items = (value,)
    elif isinstance(value, (tuple, list)):
        items = tuple(value)
    else:
        raise TypeError(f"ParamKey.{what}: {value!r} is a {type(value).__name__}, expected a {kind.__name__} "
                        "or a list of them")
    for item in items:
        if not isinstance(item, kind):
            raise TypeError(f"ParamKey.{what}: {item!r} is a {type(item).__name__}, expected {kind.__name__}")
    return items


@dataclass(frozen=True, init=False)
class ParamKey:
    """Selects params: any ``name`` glob (fnmatch), any truthy ``attr``, or any ``predicate`` matches."""

    name: tuple[str, ...]
    attr: tuple[str, ...]
    predicate: tuple[NamedPredicate, ...]

    def __init__(self, name: Union[str, Sequence[str]] = (), attr: Union[str, Sequence[str]] = (),
                 predicate: Union[NamedPredicate, Sequence[NamedPredicate]] = ()):
        object.__setattr__(self, "name", _as_tuple(name, "name", str))
        object.__setattr__(self, "attr", _as_tuple(attr, "attr", str))
        object.__setattr__(self, "predicate", _as_tuple(predicate, "predicate", NamedPredicate))
        if not (self.name or self.attr or self.predicate):
            raise ValueError("ParamKey: give at least one name glob, attribute or predicate")
        if any(not glob for glob in self.name) or any(not a for a in self.attr):
            raise ValueError(f"ParamKey: empty name glob or attribute in {self}")

    def matches(self, param: torch.nn.Parameter, name: str) -> bool:
        return (any(fnmatch.fnmatchcase(name, glob) for glob in self.name)
                or any(getattr(param, attr, False) for attr in self.attr)
                or any(predicate(param, name) for predicate in self.predicate))

    def __str__(self) -> str:
        parts = [f"name={list(self.name)}" if self.name else "", f"attr={list(self.attr)}" if self.attr else "",
                 f"predicate={[p.name for p in self.predicate]}" if self.predicate else ""]
        return "ParamKey(" + ", ".join(p for p in parts if p) + ")"


class ParamGroupOverride(TypedDict, total=False):
    """What an override may set for the params its key selects."""

    max_lr: float
    min_lr: float
    start_wd: float
    end_wd: float
    wd_mult: float
    lr_mult: float
    eps: float


OVERRIDE_KEYS = tuple(ParamGroupOverride.__annotations__)
# Group values an override sets under another name (the schedule computes them from these).
_RENAMED = {"lr": "max_lr (or lr_mult)", "weight_decay": "wd_mult (or start_wd/end_wd)"}


def _validate_override(key: ParamKey, override) -> None:
    if not isinstance(override, dict):
        raise TypeError(f"override for {key}: expected a dict (ParamGroupOverride), got {type(override).__name__}")
    for field, value in override.items():
        if field not in OVERRIDE_KEYS:
            raise ValueError(f"override for {key}: unknown key {field!r}; allowed: {', '.join(OVERRIDE_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"override for {key}: {field}={value!r} must be a finite number")
        if field == "eps" and value < MIN_EPS:
            raise ValueError(f"override for {key}: eps={value!r} must be at least 2**-126 ({MIN_EPS:.4g}), the "
                             "smallest normal float32: the update adds it in float32")
        if value < 0:
            raise ValueError(f"override for {key}: {field}={value!r} must be >= 0")


def _whole_optimizer_settings(config, override: dict) -> set:
    """Keys of ``override`` that are settings of the whole optimizer (``OptimizerConfig`` fields that are
    not override keys), e.g. ``optimizer``."""
    return {field for field in override if field not in OVERRIDE_KEYS and field not in _RENAMED
            and isinstance(field, str) and field in held_names(type(config))}


def _effective_override(config, override: dict) -> dict:
    """``override`` without the whole-optimizer settings it repeats (checked equal to the config's): they
    change nothing, so they do not split a group."""
    repeated = _whole_optimizer_settings(config, override)
    return {field: value for field, value in override.items() if field not in repeated}


def check_config_overrides_consistency(config, config_overrides) -> bool:
    """Validate ``config_overrides``: ParamKey keys, ParamGroupOverride values with known keys only.

    Settings that cannot differ between groups (the optimizer itself, precision, capture) are not
    ParamGroupOverride keys: an override may repeat the config's value (Megatron-Core's consistency check
    accepts ``optimizer`` equal to the base one), a different value is an error naming the key.
    """
    if config_overrides is None:
        return True
    if not isinstance(config_overrides, dict):
        raise TypeError(f"config_overrides: expected a dict of ParamKey -> ParamGroupOverride, got "
                        f"{type(config_overrides).__name__}")
    for key, override in config_overrides.items():
        if not isinstance(key, ParamKey):
            raise TypeError(f"config_overrides: key {key!r} is a {type(key).__name__}, expected a ParamKey")
        for field in override if isinstance(override, dict) else ():
            if field in _RENAMED:
                raise ValueError(f"override for {key}: {field!r} is not an override key; use {_RENAMED[field]}")
        for field in _whole_optimizer_settings(config, override) if isinstance(override, dict) else ():
            base = held_value(config, field)  # Megatron-Core's flat names too: "adam_beta1" is config.adam.beta1
            if override[field] != base or isinstance(override[field], bool) != isinstance(base, bool):
                raise ValueError(f"override for {key}: {field}={override[field]!r} differs from the config's "
                                 f"{base!r}; {field!r} is a setting of the whole optimizer and cannot be overridden "
                                 f"per param group; allowed: {', '.join(OVERRIDE_KEYS)}")
        _validate_override(key, _effective_override(config, override) if isinstance(override, dict) else override)
    return True


def _is_embedding_class(param: torch.nn.Parameter, name: str) -> bool:
    """MuP's embedding class, Megatron-Core's order of evidence: a truthy ``shared_embedding``; else an
    ``is_embedding_parameter`` attribute decides (even when False); only without both, "embedding" in the
    lower-cased name. ``is_embedding_or_output_parameter`` alone does not make a param embedding-class: an
    output layer's fan-in is the hidden width, so MuP scales it like a hidden matrix."""
    if getattr(param, "shared_embedding", False):
        return True
    if hasattr(param, "is_embedding_parameter"):
        return bool(param.is_embedding_parameter)
    return "embedding" in name.lower()


def _is_vector_like(param: torch.nn.Parameter, name: str) -> bool:
    return param.ndim <= 1 or _is_embedding_class(param, name)


def _is_qk_layernorm(name: str) -> bool:
    # Megatron-Core's test, a substring of the name: its attention modules name them so.
    return "q_layernorm." in name or "k_layernorm." in name


def _no_weight_decay_key(config) -> ParamKey:
    """Biases and 1-D params; with ``apply_wd_to_qk_layernorm`` less those of q_layernorm / k_layernorm
    (Megatron-Core's two rules: the classic one, and Qwen3-Next's, which decays the QK norms' scales)."""
    if config.apply_wd_to_qk_layernorm:
        return ParamKey(predicate=NamedPredicate(
            "ndim_1_or_bias_not_qk_layernorm",
            lambda p, name: (p.ndim == 1 or name.endswith(".bias")) and not _is_qk_layernorm(name)))
    return ParamKey(name="*.bias", predicate=NamedPredicate("ndim_1", lambda p, _: p.ndim == 1))


def get_standard_config_overrides(config) -> dict[ParamKey, ParamGroupOverride]:
    """No weight decay for biases and 1-D params (but for q/k layernorms' with ``apply_wd_to_qk_layernorm``);
    ``decoupled_lr`` for embedding/output params."""
    overrides: dict[ParamKey, ParamGroupOverride] = {_no_weight_decay_key(config): {"wd_mult": 0.0}}
    if config.decoupled_lr is not None:
        # Without decoupled_min_lr the group keeps the config's min_lr, as in Megatron-Core (which sets
        # min_lr here only when decoupled_min_lr is given).
        decoupled: ParamGroupOverride = {"max_lr": config.decoupled_lr}
        if config.decoupled_min_lr is not None:
            decoupled["min_lr"] = config.decoupled_min_lr
        overrides[ParamKey(attr="is_embedding_or_output_parameter")] = decoupled
    return overrides


MUP_SPELLINGS = {"dist_muon": muon_family.NAME}
"""``optimizer_type`` names Megatron uses beside the families' own: "dist_muon" (Megatron-LM's ``--optimizer``
for Muon with its layer-wise distributed optimizer; its MuP rules read it as Muon)."""


def get_mup_config_overrides(config, mup_width_mult: float, optimizer_type: Optional[str] = None
                             ) -> dict[ParamKey, ParamGroupOverride]:
    """MuP's per-class learning rates (and Adam's eps) for width multiplier ``m = mup_width_mult``.

    MuP keeps update sizes stable across widths so hyperparameters tuned on a narrow model transfer. The
    rules are Megatron-Core's ``get_mup_config_overrides`` (megatron/core/optimizer/__init__.py):

    - classes: *embedding-class* as ``_is_embedding_class`` says; *vector-like* = embedding-class or
      ndim <= 1; *matrix-like* = everything else, hidden matrices and the output layer alike;
    - each family's ``MupRule`` (graphstep/families/) says what it scales: Adam (also "adamw"):
      matrix-like params get lr / m and eps / m; SGD: vector-like params get lr x m, matrix-like ones keep
      lr; Lion and Muon: matrix-like params get lr / m (no eps), except the matrices Muon itself updates
      (``muon.takes``): only the params its scalar optimizer takes get it;
    - with ``decoupled_lr`` set, params marked ``is_embedding_or_output_parameter`` keep their decoupled
      lr (MuP sets no lr for them), though Adam's eps / m still applies to a matrix-like output layer;
    - nothing when m == 1.

    The schedule floor scales with the peak (``min_lr`` x the same factor when ``config.min_lr`` is set),
    so ``min_lr <= max_lr`` still holds. ``optimizer_type`` (any case) defaults to ``config.optimizer``;
    Megatron's other spellings (``MUP_SPELLINGS``: "dist_muon") are read as the family they name; any other
    name that is no registered family (nor an alias of one) raises ValueError naming it.
    """
    if isinstance(mup_width_mult, bool) or not isinstance(mup_width_mult, (int, float)) \
            or not 0 < mup_width_mult < math.inf:
        raise ValueError(f"get_mup_config_overrides: mup_width_mult={mup_width_mult!r} must be a finite number > 0 "
                         "(hidden_size / base_hidden_size)")
    optimizer_type = config.optimizer if optimizer_type is None else optimizer_type
    if not isinstance(optimizer_type, str) or not optimizer_type:
        raise TypeError(f"get_mup_config_overrides: optimizer_type={optimizer_type!r} must be the name of an "
                        f"optimizer family, like {config.optimizer!r}")
    try:
        name = optimizer_type.lower()
        rule = get_family(MUP_SPELLINGS.get(name, name), aliases=True).mup
    except ValueError as exc:
        raise ValueError(f"get_mup_config_overrides: optimizer_type={optimizer_type!r} names no optimizer family "
                         f"MuP has a rule for ({exc})") from None
    if mup_width_mult == 1:
        return {}
    return _mup_overrides(config, float(mup_width_mult), rule)


def _mup_overrides(config, m: float, rule) -> dict[ParamKey, ParamGroupOverride]:
    """The overrides of one family's ``MupRule`` (``get_mup_config_overrides``)."""
    decoupled = config.decoupled_lr is not None

    def scaled_lr(factor: float) -> ParamGroupOverride:
        override: ParamGroupOverride = {"max_lr": config.lr * factor}
        if config.min_lr is not None:
            override["min_lr"] = config.min_lr * factor
        return override

    def keeps_decoupled_lr(param) -> bool:
        return decoupled and bool(getattr(param, "is_embedding_or_output_parameter", False))

    def matrix_like(param, name):
        return not _is_vector_like(param, name)

    def matrix_like_lr(param, name):
        return (matrix_like(param, name) and not keeps_decoupled_lr(param)
                and not (rule.keeps_lr is not None and rule.keeps_lr(param)))

    def vector_like_lr(param, name):
        return _is_vector_like(param, name) and not keeps_decoupled_lr(param)

    if rule.scales == "vector_like":
        return {ParamKey(predicate=NamedPredicate("mup_vector_like_lr", vector_like_lr)): scaled_lr(m)}
    lr_key = ParamKey(predicate=NamedPredicate("mup_matrix_like_lr", matrix_like_lr))
    if rule.eps is None:
        return {lr_key: scaled_lr(1.0 / m)}
    eps: ParamGroupOverride = {"eps": rule.eps(config) / m}
    if not decoupled:  # both keys would select the same params: one key with both values
        return {ParamKey(predicate=NamedPredicate("mup_matrix_like", matrix_like)): {**scaled_lr(1.0 / m), **eps}}
    return {lr_key: scaled_lr(1.0 / m), ParamKey(predicate=NamedPredicate("mup_matrix_like_eps", matrix_like)): eps}


def _merged_override(name: str, param, config_overrides: dict) -> Optional[dict]:
    """The merge of every override whose key matches the param; None when no key matches (an empty
    override that matches still gives {}: Megatron-Core groups those params apart)."""
    merged: Optional[dict] = None
    source: dict = {}
    for key, override in config_overrides.items():
        if not key.matches(param, name):
            continue
        merged = {} if merged is None else merged
        for field, value in override.items():  # (already stripped of repeated whole-optimizer settings)
            if field in merged and merged[field] != value:
                raise ValueError(f"param '{name}': {source[field]} sets {field}={merged[field]!r} but {key} sets "
                                 f"{field}={value!r}; make the keys disjoint or agree on the value")
            merged[field] = value
            source[field] = key
    return merged


def build_param_groups(named_params: Sequence[tuple[str, torch.nn.Parameter]], config,
                       config_overrides: Optional[dict] = None) -> list[dict]:
    """Param groups for ``named_params`` (in model order) under ``config`` and its overrides.

    ``config_overrides=None`` applies ``get_standard_config_overrides(config)``; ``{}`` applies none.
    Each group carries the floats the update reads (``lr``, ``weight_decay``, ``betas``/``eps`` or
    ``momentum``) and what schedules need (``max_lr``, ``min_lr`` — None when neither the config nor an
    override sets it, read as 0 —, ``lr_mult``, ``wd_mult``, ``start_wd``, ``end_wd``), plus
    ``param_names`` and the merged ``overrides``. Groups come in the order the module docstring gives.
    """
    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    check_config_overrides_consistency(config, config_overrides)
    config_overrides = _effective_overrides(config, config_overrides)

    groups: dict[Optional[tuple], dict] = {}
    seen_names: set[str] = set()
    seen_params: dict[int, str] = {}
    for entry in named_params:
        name, param = _checked_entry(entry, seen_names, seen_params)
        merged = _merged_override(name, param, config_overrides)
        signature = None if merged is None else tuple(sorted(merged.items()))
        if signature not in groups:
            groups[signature] = _new_group(config, merged or {}, name)
        groups[signature]["params"].append(param)
        groups[signature]["param_names"].append(name)
    return [groups[signature] for signature in sorted(groups, key=_group_order)]


def _effective_overrides(config, config_overrides: dict) -> dict:
    """The overrides without the whole-optimizer settings they repeat; a key left with nothing by that is
    dropped (it changes nothing, so it must not split a group), while a key given ``{}`` stays."""
    effective = {}
    for key, override in config_overrides.items():
        kept = _effective_override(config, override)
        if kept or not override:
            effective[key] = kept
    return effective


def _group_order(signature: Optional[tuple]) -> tuple:
    """Megatron-Core's sort key: the no-override group (None) first, then the sorted override tuples, the
    empty one before any other."""
    return (signature is not None, signature or ())


def _checked_entry(entry, seen_names: set, seen_params: dict) -> tuple[str, torch.nn.Parameter]:
    """One (name, param) pair, refused if malformed, frozen or seen before: a param in two groups would be
    updated twice, and checkpoints match groups by their param names."""
    if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
            and isinstance(entry[1], torch.Tensor)):
        raise TypeError(f"build_param_groups: expected (name, Parameter) pairs, got {entry!r:.80}")
    name, param = entry
    if not param.requires_grad:
        raise ValueError(f"build_param_groups: param '{name}' does not require grad; leave frozen params out")
    if name in seen_names:
        raise ValueError(f"build_param_groups: param name '{name}' appears twice")
    if id(param) in seen_params:
        raise ValueError(f"build_param_groups: param '{name}' is the same tensor as '{seen_params[id(param)]}' "
                         "(shared weights): list it once")
    seen_names.add(name)
    seen_params[id(param)] = name
    return name, param


def _new_group(config, override: dict, first_param_name: str) -> dict:
    # min_lr may stay None, as in Megatron-Core's groups: schedules read it as 0 (graphstep.scheduler).
    max_lr = override.get("max_lr", config.lr)
    min_lr = override.get("min_lr", config.min_lr)
    if min_lr is not None and min_lr > max_lr:
        raise ValueError(f"param '{first_param_name}': min_lr={min_lr} exceeds max_lr={max_lr} (merged override "
                         f"{override}); lower min_lr in the override or in OptimizerConfig")
    lr_mult = override.get("lr_mult", 1.0)
    wd_mult = override.get("wd_mult", 1.0)
    start_wd = override.get("start_wd", config.weight_decay)
    group = {
        "params": [], "param_names": [],
        "lr": max_lr * lr_mult, "max_lr": max_lr, "min_lr": min_lr,
        "lr_mult": lr_mult, "wd_mult": wd_mult,
        "weight_decay": start_wd * wd_mult, "start_wd": start_wd, "end_wd": override.get("end_wd", config.weight_decay),
        # Every group carries eps (Megatron-Core's groups do; MuP's eps override sets it), whatever its family.
        "eps": override.get("eps", config.adam.eps),
        "overrides": dict(override),
    }
    group.update(get_family(config.optimizer).group_defaults(config))  # betas, momentum, ...: its family's own
    return group
