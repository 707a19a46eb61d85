"""Megatron-Core's names for what graphstep's ``OptimizerConfig`` holds elsewhere or not at all, mapped in this
one place so that a config written for Megatron-Core builds unchanged:

- a family's flat option (``muon_momentum=0.9``) is that option of the family's options (``muon.momentum``);
  given beside the options object (as ``dataclasses.replace`` gives it), it changes that one option of it;
- ``RENAMED``: an older spelling of a flat option (Megatron-Core 0.16.1's ``muon_use_nesterov``);
- ``NOT_OFFERED``: switches of features graphstep does not offer; their default (False) is accepted;
- ``NO_EFFECT``: fields graphstep accepts and ignores (Megatron-Core's timers and logging, its SOAP and
  adaptive-Muon optimizers, its choice of host optimizer); each is type-checked, then dropped.

Code reads the options (``config.muon.momentum``); the flat names are for writing a config only.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Callable, NamedTuple, Optional

from .validation import check_type, fail


class MegatronOnly(NamedTuple):
    """A Megatron-Core field graphstep accepts without effect: its default there, type and meaning."""

    default: object
    hint: object
    meaning: str


_SOAP = "Megatron-Core's, for its \"soap\" optimizer (not offered by graphstep)"
_ADAPTIVE_MUON = "Megatron-Core's, for its \"adaptive_muon\" optimizer (not offered by graphstep)"
NO_EFFECT = {
    "barrier_with_L1_time": MegatronOnly(False, bool, "Megatron-Core's timers (graphstep's step reports through "
                                         "``StepResult`` and NVTX ranges)"),
    "timers": MegatronOnly(None, Optional[Callable], "Megatron-Core's timers"),
    "config_logger_dir": MegatronOnly("", str, "Megatron-Core's config dump directory"),
    "use_torch_optimizer_for_cpu_offload": MegatronOnly(False, bool, "Megatron-Core's choice of host optimizer: "
                                                        "graphstep's host update always runs torch's fused CPU "
                                                        "kernels, so both values do the same"),
    "soap_shampoo_beta": MegatronOnly(0.95, float, _SOAP),
    "soap_precondition_frequency": MegatronOnly(1, int, _SOAP),
    "soap_use_kl_shampoo": MegatronOnly(True, bool, _SOAP),
    "adaptive_muon_moment2_method": MegatronOnly("adamuon", str, _ADAPTIVE_MUON),
    "adaptive_muon_beta2": MegatronOnly(0.95, float, _ADAPTIVE_MUON),
    "adaptive_muon_eps": MegatronOnly(1e-8, float, _ADAPTIVE_MUON),
}

NOT_OFFERED = {
    "reuse_grad_buf_for_mxfp8_param_ag": "mxfp8 weights are not offered (fp8_recipe 'tensorwise' or 'delayed')",
    "overlap_param_gather_with_optimizer_step": "the param all-gather is part of the (captured) step; "
    "overlap_param_gather defers it to the next forward instead",
    "offload_optimizer_states": "optimizer state does not move between steps; optimizer_cpu_offload keeps "
    "a fraction of it on the host for good",
}
"""Megatron-Core's switches for features graphstep does not offer: False (their default) is accepted, True refused."""

RENAMED = {"muon_use_nesterov": "muon_nesterov"}
"""Megatron-Core 0.16.1's spellings -> the newest's. None (graphstep's former default) means not given."""


def family_options(cls) -> dict[str, type]:
    """The fields of config class ``cls`` that hold a family's options: field name -> options class."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def flat_names(cls) -> dict[str, tuple[str, str]]:
    """Megatron-Core's flat name of every family option: ``"muon_momentum"`` -> ``("muon", "momentum")``."""
    return {f"{field}_{option.name}": (field, option.name)
            for field, options in family_options(cls).items() for option in dataclasses.fields(options)}


def accepted_names(cls) -> tuple[str, ...]:
    """Every keyword this adapter takes beside the fields of ``cls``."""
    return (*flat_names(cls), *RENAMED, *NOT_OFFERED, *NO_EFFECT)


def held_names(cls) -> frozenset[str]:
    """Every name of a setting a config of class ``cls`` holds: its fields, and Megatron-Core's names of its
    family options and of the switches it does not offer (not those without effect: they are held nowhere)."""
    return frozenset((*(f.name for f in dataclasses.fields(cls)), *flat_names(cls), *RENAMED, *NOT_OFFERED))


def held_value(config, name: str):
    """What ``config`` holds for ``name`` (one of ``held_names``): ``"muon_momentum"`` is ``config.muon.momentum``;
    a ``NOT_OFFERED`` switch is False, the one value accepted."""
    name = RENAMED.get(name, name)
    if name in NOT_OFFERED:
        return False
    flat = flat_names(type(config))
    if name in flat:
        field, option = flat[name]
        return getattr(getattr(config, field), option)
    return getattr(config, name)


def accepting_megatron_names(cls, init) -> Callable:
    """``init`` (``cls.__init__``), first turning Megatron-Core's names among its keywords into fields of ``cls``."""
    flat = flat_names(cls)
    options = family_options(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **_as_fields(kwargs, flat, options, defaults))
    return __init__


def _as_fields(kwargs: dict, flat: dict, options: dict, defaults: dict) -> dict:
    kwargs = dict(kwargs)
    for name in [n for n in kwargs if n in NO_EFFECT]:
        check_type(name, kwargs.pop(name), NO_EFFECT[name].hint)
    for name in [n for n in kwargs if n in NOT_OFFERED]:
        value = kwargs.pop(name)
        check_type(name, value, bool)
        if value:
            fail(name, value, f"not offered by graphstep: {NOT_OFFERED[name]}")
    for old, new in RENAMED.items():
        value = kwargs.pop(old, None)
        if value is None:
            continue
        check_type(old, value, Optional[bool])
        if new in kwargs and kwargs[new] != value:
            fail(old, value, f"contradicts {new}={kwargs[new]!r}: they name one setting (Megatron-Core 0.16.1's "
                 f"name and its newest); give one")
        kwargs[new] = value
    changes: dict[str, dict] = {}
    for name in [n for n in kwargs if n in flat]:
        field, option = flat[name]
        changes.setdefault(field, {})[option] = kwargs.pop(name)
    for field, option_changes in changes.items():
        base = kwargs.get(field, defaults[field])
        check_type(field, base, options[field])
        kwargs[field] = dataclasses.replace(base, **option_changes)
    return kwargs
