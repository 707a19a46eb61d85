"""Optimizer families: what the update stage needs to know to run one, declared in one place.

A family (Adam, SGD, Lion, Muon) is:

- its **kernel**, one function per implementation module in ``graphstep/kernels/`` (``fused``,
  ``compiled``, ``reference``) with one signature across them; or, for a family whose math has one
  implementation (Lion, Muon), its own kernels module (``Family.kernels``), which then also declares
  the family's live fields;
- its **hyperparameters**: which ``HyperParams`` field feeds which kernel keyword;
- its **state**: the names of the optimizer-state buffers it keeps per element;
- its **call**: how the update stage hands a group's views and hyperparameters to the kernel (and,
  optionally, **call_groups**: all of a step's groups of the family in one call);
- its **views** (optional): how a group's slice of the flat buffers is cut for the kernel. The default is
  one flat view per segment (elementwise rules); Muon needs whole matrices, batched by shape
  (``graphstep/matrix_views.py``).

Which hyperparameters are live (0-d device tensors a captured step reads anew every replay) and which
are baked (Python floats the kernel takes; a capture records them, the engine guards them and
recaptures on change) is the implementation's declaration, ``LIVE_FIELDS`` of its kernels module, met
with the family's fields at build by ``live_fields``. The update stage resolves each group's sources
once at build; the per-step path does no name look-ups.

Adding an elementwise family: write its kernel in each implementation module (or in those that support
it; or one module of its own, ``Family.kernels``), add a ``Family`` below to ``FAMILIES``, and accept
its name in ``OptimizerConfig.optimizer``.
Nothing in the runner, the engine or the stages changes; param groups choose a family through their
``optimizer`` key (a config override), defaulting to ``OptimizerConfig.optimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Mapping, Optional, Sequence

import torch

from . import matrix_views
from .kernels import lion as lion_kernels
from .kernels import muon as muon_kernels


@dataclass(frozen=True)
class GroupViews:
    """One param group's slice of this rank's shard: parallel lists of flat views, one per segment."""

    params: list[torch.Tensor]  # main params (fp32)
    grads: list[torch.Tensor]  # grads in the main params' dtype
    state: Mapping[str, list[torch.Tensor]]


@dataclass(frozen=True)
class ViewSources:
    """Per flat buffer, the tensors a group's views are cut from.

    Each is addressed in shard coordinates (``Segment.shard_start``: this rank's compact shard) unless its
    ``*_in_flat`` flag says it is a whole flat buffer holding this rank's shard in place (fp32 params are
    their own main params; grads are reduced into ``grad_flat``): then ``Segment.flat_start``. With one
    rank the two coincide.
    """

    main: list[torch.Tensor]  # main params (fp32)
    grads: list[torch.Tensor]  # grads in the main params' dtype
    state: Mapping[str, list[torch.Tensor]]
    main_in_flat: Sequence[bool] = ()
    grads_in_flat: Sequence[bool] = ()


def flat_views(ctx, group: int, segments: Sequence, sources: ViewSources) -> GroupViews:
    """The default view builder: one flat view per segment of the group in this rank's shard."""
    def cut(tensors, in_flat=()):
        return [tensors[s.buffer][s.flat_start:s.flat_end] if in_flat and in_flat[s.buffer]
                else tensors[s.buffer][s.shard_start:s.shard_end] for s in segments]

    return GroupViews(cut(sources.main, sources.main_in_flat), cut(sources.grads, sources.grads_in_flat),
                      {name: cut(t) for name, t in sources.state.items()})


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
    call_groups: Optional[Callable[..., None]] = None
    """call_groups(kernels, groups, scalars, config, grad_scale), ``groups`` a list of (views,
    hyperparameters): all of a step's groups of the family in one kernel call (Adam: the compiled kernel
    runs them as one loop; ``run``). None: ``call`` per group."""
    kernels: Optional[ModuleType] = None
    """The family's own kernels module, used whatever ``OptimizerConfig.kernel`` says; None: the
    configured implementation (fused, compiled, reference)."""
    views: Callable[..., GroupViews] = flat_views
    """views(ctx, group, segments, sources) -> the views ``call`` hands to the kernel."""
    check: Optional[Callable[..., None]] = None
    """check(ctx, group): raise at build when the family cannot run this group (e.g. sharding)."""
    group_problem: Optional[Callable[[dict, object], Optional[str]]] = None
    """group_problem(param_group, config): what in a group's current values the built step cannot honour
    (a schedule switching on momentum the build gave no buffers for), in words; None when all is well.
    The engine asks before each step and refuses the step with it."""

    @property
    def batch_by_shape(self) -> bool:
        """Whether the family needs whole matrices (its own view builder): the layout then sorts its groups'
        params by shape so same-shape matrices are evenly spaced."""
        return self.views is not flat_views

    def kernels_for(self, configured: ModuleType) -> ModuleType:
        """The kernels module this family's groups run: its own, else the configured implementation."""
        return self.kernels if self.kernels is not None else configured

    def run(self, kernels: ModuleType, groups: Sequence, scalars: "StepScalars", config, grad_scale) -> None:
        """The update of ``groups`` (each (views, hyperparameters)) with ``kernels`` (this family's own, or
        the configured implementation)."""
        if self.call_groups is not None:
            self.call_groups(kernels, groups, scalars, config, grad_scale)
            return
        for views, hyper in groups:
            self.call(kernels, views, scalars, config, grad_scale, **hyper)

    def live_fields(self, kernels: ModuleType) -> frozenset[str]:
        """The fields of this family that ``kernels`` reads from device tensors (the rest are baked)."""
        return frozenset(field for _, field in self.hyperparameters) & self.kernels_for(kernels).LIVE_FIELDS


def _adam(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    _adam_groups(kernels, [(views, hyper)], scalars, config, grad_scale)


def _adam_groups(kernels, groups: Sequence, scalars: StepScalars, config, grad_scale) -> None:
    kernels.adam_groups([(views.params, views.grads, views.state["exp_avg"], views.state["exp_avg_sq"], hyper)
                         for views, hyper in groups], step=scalars.step, decoupled=config.decoupled_weight_decay,
                        grad_scale=grad_scale, found_inf=scalars.found_inf)


def _sgd(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    kernels.sgd(views.params, views.grads, views.state.get("momentum_buffer", []), nesterov=config.sgd_nesterov,
                grad_scale=grad_scale, found_inf=scalars.found_inf, **hyper)


ADAM = Family(
    name="adam",
    hyperparameters=(("lr", "lr"), ("beta1", "beta1"), ("beta2", "beta2"), ("weight_decay", "weight_decay"),
                     ("eps", "eps")),
    state_names=lambda config: ("exp_avg", "exp_avg_sq"),
    call=_adam,
    call_groups=_adam_groups,
)

def _sgd_group_problem(group: dict, config) -> Optional[str]:
    if config.sgd_momentum == 0 and group.get("momentum", 0.0) != 0:
        return (f"momentum={group['momentum']!r}, but the optimizer was built with sgd_momentum=0 and keeps no "
                "momentum buffers: build it with sgd_momentum > 0 to schedule momentum (torch's OneCycleLR "
                "cycles it unless cycle_momentum=False)")
    if "nesterov" in group and bool(group["nesterov"]) != config.sgd_nesterov:
        return (f"nesterov={group['nesterov']!r}: fixed at build by OptimizerConfig.sgd_nesterov="
                f"{config.sgd_nesterov}; build a new optimizer to change it")
    return None


SGD = Family(
    name="sgd",
    hyperparameters=(("lr", "lr"), ("weight_decay", "weight_decay"), ("momentum", "momentum")),
    state_names=lambda config: ("momentum_buffer",) if config.sgd_momentum > 0 else (),
    call=_sgd,
    group_problem=_sgd_group_problem,
)



def _lion(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    kernels.lion(views.params, views.grads, views.state["exp_avg"], grad_scale=grad_scale,
                 found_inf=scalars.found_inf, **hyper)


def _muon(kernels, views: GroupViews, scalars: StepScalars, config, grad_scale, **hyper) -> None:
    kernels.muon(views.params, views.grads, views.state["momentum_buffer"], nesterov=config.muon_nesterov,
                 decoupled=config.decoupled_weight_decay, grad_scale=grad_scale, found_inf=scalars.found_inf,
                 ns_steps=config.muon_num_ns_steps, coefficient_type=config.muon_coefficient_type,
                 scale_mode=config.muon_scale_mode, extra_scale_factor=config.muon_extra_scale_factor,
                 fp32_matmul_prec=config.muon_fp32_matmul_prec, qkv_splits=views.qkv_splits, **hyper)


LION = Family(
    name="lion",
    hyperparameters=(("lr", "lr"), ("beta1", "beta1"), ("beta2", "beta2"), ("weight_decay", "weight_decay")),
    state_names=lambda config: lion_kernels.STATE_NAMES,
    call=_lion,
    kernels=lion_kernels,
)

MUON = Family(
    name="muon",
    hyperparameters=(("lr", "lr"), ("weight_decay", "weight_decay"), ("momentum", "momentum")),
    state_names=lambda config: muon_kernels.STATE_NAMES,
    call=_muon,
    kernels=muon_kernels,
    views=matrix_views.matrix_views,
    check=matrix_views.check_whole_matrices,
)

FAMILIES: dict[str, Family] = {family.name: family for family in (ADAM, SGD, LION, MUON)}


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
