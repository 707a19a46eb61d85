"""Routing params to optimizer families (Megatron-Core's per-group ``optimizer`` key).

``build_family_param_groups`` runs ``overrides.build_param_groups`` and then gives each param group the
family that updates it (``optimizer="muon"``: 2-D hidden matrices to Muon, the rest to
``muon_scalar_optimizer``), with that family's hyperparameters in the group. The engine calls it; the
optimizer families themselves are declared in ``graphstep/families.py``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .overrides import build_param_groups, get_standard_config_overrides, muon_managed

_FAMILY_NAMES = ("adam", "sgd", "lion", "muon")

_FAMILY_NAMES = ("adam", "sgd", "lion", "muon")


def build_family_param_groups(named_params: Sequence[tuple[str, torch.nn.Parameter]], config,
                              config_overrides: Optional[dict] = None) -> list[dict]:
    """``build_param_groups``, then each param routed to its optimizer family through the group key
    ``optimizer`` (Megatron-Core's per-group key), with that family's hyperparameters in the group.

    Routing, as Megatron-Core does it: with ``optimizer="muon"``, 2-D params go to "muon" unless they are
    embedding/output params (``is_embedding_or_output_parameter`` or ``shared_embedding``) or carry
    ``use_muon=False``; the rest go to ``muon_scalar_optimizer``. An override may name a param's family
    itself (``{ParamKey(...): {"optimizer": "adam"}}``), for any ``config.optimizer``; a key setting it
    takes precedence over the rule. For "adam" and "sgd" without such overrides the groups are those of
    ``build_param_groups``, unchanged (no ``optimizer`` key).

    Family hyperparameters: Muon groups ``momentum`` (``muon_momentum``: live, so torch's OneCycleLR may
    cycle it), Lion groups ``betas`` = (``lion_beta1``, ``lion_beta2``), Adam groups ``betas``/``eps``,
    SGD groups ``momentum``/``nesterov``. Groups keep ``build_param_groups``'s order; a group split between
    families becomes one group per family, in the order its params first appear.
    """
    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    chosen: dict = {}  # ParamKey -> family name, from overrides that set "optimizer"
    stripped: dict = {}
    for key, override in (config_overrides.items() if isinstance(config_overrides, dict) else ()):
        if isinstance(override, dict) and "optimizer" in override:
            family = override["optimizer"]
            if family not in _FAMILY_NAMES:
                raise ValueError(f"override for {key}: optimizer={family!r} must be one of "
                                 f"{', '.join(map(repr, _FAMILY_NAMES))}")
            chosen[key] = family
            override = {k: v for k, v in override.items() if k != "optimizer"}
        stripped[key] = override
    groups = build_param_groups(named_params, config, stripped if isinstance(config_overrides, dict)
                                else config_overrides)
    if config.optimizer in ("adam", "sgd") and not chosen:
        return groups  # build_param_groups already gives these families their hyperparameters

    def family_of(param, name: str) -> str:
        picked = {family for key, family in chosen.items() if key.matches(param, name)}
        if len(picked) > 1:
            raise ValueError(f"param '{name}': overrides route it to several optimizers {sorted(picked)}; make the "
                             "keys disjoint")
        if picked:
            return picked.pop()
        if config.optimizer != "muon":
            return config.optimizer
        return "muon" if muon_managed(param) else config.muon_scalar_optimizer

    routed = []
    for group in groups:
        by_family: dict[str, dict] = {}
        for param, name in zip(group["params"], group["param_names"]):
            family = family_of(param, name)
            if family not in by_family:
                by_family[family] = _family_group(config, group, family)
            by_family[family]["params"].append(param)
            by_family[family]["param_names"].append(name)
        routed += by_family.values()
    return routed


def _family_group(config, group: dict, family: str) -> dict:
    """A copy of ``group`` (no params) for ``family``, with that family's hyperparameters only."""
    new = {k: v for k, v in group.items() if k not in ("params", "param_names", "betas", "momentum", "nesterov")}
    new.update(params=[], param_names=[], optimizer=family, overrides={**group["overrides"], "optimizer": family})
    if family == "adam":
        new["betas"] = (config.adam_beta1, config.adam_beta2)
    elif family == "lion":
        new["betas"] = (config.lion_beta1, config.lion_beta2)
    elif family == "muon":
        new["momentum"] = config.muon_momentum
    else:
        new.update(momentum=config.sgd_momentum, nesterov=config.sgd_nesterov)
    return new
