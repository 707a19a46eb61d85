"""Optimizer families: what the update stage needs to know to run one, declared in one place.

A family (Adam, SGD; next Muon, Lion) is:

- its **kernel**, one function per implementation module in ``graphstep/kernels/`` (``fused``,
  ``compiled``, ``reference``) with one signature across them;
- its **hyperparameters**: which ``HyperParams`` field feeds which kernel keyword;
- its **state**: the names of the optimizer-state buffers it keeps per element;
- its **call**: how the update stage hands a group's views and hyperparameters to the kernel.

Which hyperparameters are live (0-d device tensors a captured step reads anew every replay) and which
are baked (Python floats the kernel takes; a capture records them, the engine guards them and
recaptures on change) is the implementation's declaration, ``LIVE_FIELDS`` of its kernels module, met
with the family's fields at build by ``live_fields``. The update stage resolves each group's sources
once at build; the per-step path does no name look-ups.

Adding an elementwise family: write its kernel in each implementation module (or in those that support
it), add a ``Family`` below to ``FAMILIES``, and accept its name in ``OptimizerConfig.optimizer``.
Nothing in the runner, the engine or the stages changes; param groups choose a family through their
``optimizer`` key (a config override), defaulting to ``OptimizerConfig.optimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Mapping, Sequence

import torch


@dataclass(frozen=True)
class GroupViews:
    """One param group's slice of this rank's shard: parallel lists of flat views, one per segment."""

    params: list[torch.Tensor]  # main params (fp32)
    grads: list[torch.Tensor]  # grads in the main params' dtype
    state: Mapping[str, list[torch.Tensor]]


@dataclass(frozen=True)
class StepScalars:
    """The step-wide device scalars every kernel call gets."""

    step: torch.Tensor
    found_inf: torch.Tensor


@dataclass(frozen=True)
class Family:
    name: str
    hyperparameters: tuple[tuple[str, str], ...]  # (kernel keyword, HyperParams field)
    state_names: Callable[[object], tuple[str, ...]]  # config -> names of the per-element state buffers
    call: Callable[..., None]  # call(kernels, views, scalars, config, grad_scale, **hyperparameters)

    def live_fields(self, kernels: ModuleType) -> frozenset[str]:
        """The fields of this family that ``kernels`` reads from device tensors (the rest are baked)."""
        return frozenset(field for _, field in self.hyperparameters) & kernels.LIVE_FIELDS


def _adam(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    kernels.adam(views.params, views.grads, views.state["exp_avg"], views.state["exp_avg_sq"], step=scalars.step,
                 decoupled=config.decoupled_weight_decay, grad_scale=grad_scale, found_inf=scalars.found_inf,
                 **hyper)


def _sgd(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    kernels.sgd(views.params, views.grads, views.state.get("momentum_buffer", []), nesterov=config.sgd_nesterov,
                grad_scale=grad_scale, found_inf=scalars.found_inf, **hyper)


ADAM = Family(
    name="adam",
    hyperparameters=(("lr", "lr"), ("beta1", "beta1"), ("beta2", "beta2"), ("weight_decay", "weight_decay"),
                     ("eps", "eps")),
    state_names=lambda config: ("exp_avg", "exp_avg_sq"),
    call=_adam,
)

SGD = Family(
    name="sgd",
    hyperparameters=(("lr", "lr"), ("weight_decay", "weight_decay"), ("momentum", "momentum")),
    state_names=lambda config: ("momentum_buffer",) if config.sgd_momentum > 0 else (),
    call=_sgd,
)

FAMILIES: dict[str, Family] = {family.name: family for family in (ADAM, SGD)}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"optimizer={name!r}: must be one of {', '.join(map(repr, FAMILIES))}") from None


def families_of(param_groups: Sequence[dict], default: str) -> tuple[Family, ...]:
    """Per param group, its family: the group's ``optimizer`` key, else ``default``."""
    return tuple(get_family(group.get("optimizer", default)) for group in param_groups)


def state_names(families: Sequence[Family], config) -> tuple[str, ...]:
    """Every state buffer some group's family keeps, in first-use order."""
    names: list[str] = []
    for family in families:
        names += [n for n in family.state_names(config) if n not in names]
    return tuple(names)
