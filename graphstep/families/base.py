"""What an optimizer family is: the ``Family`` record and the structs its parts share.

A family (Adam, SGD, Lion, Muon) is one module of this package holding every rule about it (the
package docstring lists them); this module defines the record those modules fill in, and the structs
the update stage hands to a family's kernel call (``GroupViews``, ``ViewSources``, ``StepScalars``).
It imports nothing of graphstep, so every family module and the registry can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Mapping, Optional, Sequence

import torch


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
    state_offset: Optional[Callable[[str, int, int, int], Optional[int]]] = None
    """(name, buffer, shard_start, numel) -> where that shard range sits in ``state[name][buffer]``, which
    holds only the groups whose family keeps the name (graphstep/state/state_ranges.py); None: the identity."""

    def state_at(self, name: str, buffer: int, shard_start: int, numel: int) -> int:
        offset = shard_start if self.state_offset is None else self.state_offset(name, buffer, shard_start, numel)
        if offset is None:
            raise ValueError(f"state {name!r} is not kept for shard range [{shard_start}, {shard_start + numel}) of "
                             f"buffer {buffer}: the group's family does not declare it")
        return offset

    def only(self, names: Sequence[str]) -> "ViewSources":
        """These sources with only the state buffers ``names`` (a family's own): the rest do not span its
        groups."""
        return ViewSources(self.main, self.grads, {n: self.state[n] for n in names}, self.main_in_flat,
                           self.grads_in_flat, self.state_offset)


def flat_views(ctx, group: int, segments: Sequence, sources: ViewSources) -> GroupViews:
    """The default view builder: one flat view per segment of the group in this rank's shard."""
    def cut(tensors, in_flat=()):
        return [tensors[s.buffer][s.flat_start:s.flat_end] if in_flat and in_flat[s.buffer]
                else tensors[s.buffer][s.shard_start:s.shard_end] for s in segments]

    def cut_state(name, tensors):
        return [tensors[s.buffer][start:start + s.numel]
                for s, start in ((s, sources.state_at(name, s.buffer, s.shard_start, s.numel)) for s in segments)]

    return GroupViews(cut(sources.main, sources.main_in_flat), cut(sources.grads, sources.grads_in_flat),
                      {name: cut_state(name, t) for name, t in sources.state.items()})


@dataclass(frozen=True)
class StepScalars:
    """The step-wide device scalars every kernel call gets."""

    step: torch.Tensor
    found_inf: torch.Tensor


@dataclass(frozen=True)
class HyperField:
    """A hyperparameter a family's kernel reads: its column in the live table (graphstep/state/hyperparams.py),
    which is also the kernel's keyword, and where a param group holds it (``group[key]``, or
    ``group[key][index]`` for a tuple such as ``betas``). A group without the key reads 0 (the value is
    not its family's), except a ``required`` field."""

    column: str
    key: str
    index: Optional[int] = None
    required: bool = False

    def read(self, group: dict):
        if self.required:
            return group[self.key]
        if self.key not in group:
            return 0.0
        return group[self.key] if self.index is None else group[self.key][self.index]


# Every family reads these two; they are the live table's first columns.
LR = HyperField("lr", "lr", required=True)
WEIGHT_DECAY = HyperField("weight_decay", "weight_decay")
# Read by more than one family (a shared column): torch.optim's group keys.
BETA1 = HyperField("beta1", "betas", index=0)
BETA2 = HyperField("beta2", "betas", index=1)
MOMENTUM = HyperField("momentum", "momentum")


MIN_EPS = torch.finfo(torch.float32).tiny
"""The least ε a family that divides by √v + ε takes (2^-126, the smallest normal float32): the update adds ε in
float32 (fp32 main params, and the live hyperparameter table on an accelerator), where a smaller ε is 0 or a
subnormal that flush-to-zero arithmetic reads as 0, and an element whose grads were all 0 gets 0 / 0 = NaN."""


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _outside(value, low: float, high: float) -> bool:
    """Whether ``value`` is a number outside [low, high); False for anything else (the live table refuses what is
    not a number, graphstep/state/hyperparams.py, with its own message)."""
    return _is_number(value) and not low <= value < high


def betas_problem(group: dict, *, unit_interval_why: Optional[str] = None) -> Optional[str]:
    """What is wrong with ``group["betas"]``, or None: it must be a pair (the live table reads its two columns and
    nothing more), and with ``unit_interval_why`` (why a family's update breaks otherwise) each in [0, 1), the
    config's range."""
    betas = group.get("betas")
    if betas is None:
        return None
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        return f"betas={betas!r} must be a pair (beta1, beta2); set it back before the next step"
    if unit_interval_why is None or not any(_outside(beta, 0.0, 1.0) for beta in betas):
        return None
    return f"betas={betas!r}: each must lie in [0, 1): {unit_interval_why}; set it back before the next step"


def eps_problem(group: dict) -> Optional[str]:
    """What is wrong with ``group["eps"]`` (at least ``MIN_EPS``, as ``AdamOptions.eps``), or None."""
    if not _outside(group.get("eps"), MIN_EPS, float("inf")):
        return None
    return (f"eps={group['eps']!r} must be at least 2**-126 ({MIN_EPS:.4g}), the smallest normal float32: the update "
            "adds it to √v in float32, and a smaller eps there gives 0 / 0 = NaN where the grads were 0. "
            "Set it back before the next step")


def first_problem(*problems: Optional[str]) -> Optional[str]:
    """The first of ``problems`` that is not None (a ``group_problem`` checking several keys)."""
    return next((problem for problem in problems if problem is not None), None)


@dataclass(frozen=True)
class StateSpec:
    """One per-element optimizer-state buffer a family keeps: its name (the buffer's, the checkpoints'),
    and its invariant: ``nonnegative`` state (a second moment) is refused on load when negative, by
    both checkpoint formats."""

    name: str
    nonnegative: bool = False
    needed: Callable[[object], bool] = lambda config: True
    """config -> whether the family keeps it under this config (SGD: momentum > 0)."""


MUP_SCALES = ("matrix_like", "vector_like")


@dataclass(frozen=True)
class MupRule:
    """How MuP (``graphstep.get_mup_config_overrides``, Megatron-Core's rule) rescales this family's
    params for a width multiplier m: "matrix_like" params get lr / m, or "vector_like" ones lr x m;
    with ``eps`` (config -> the family's ε) matrix-like params also get ε / m; ``keeps_lr``
    (param -> bool) marks params the family updates itself whose lr MuP leaves alone (Muon's matrices)."""

    scales: str
    eps: Optional[Callable[[object], float]] = None
    keeps_lr: Optional[Callable[[torch.Tensor], bool]] = None

    def __post_init__(self) -> None:
        if self.scales not in MUP_SCALES:
            raise ValueError(f"MupRule.scales={self.scales!r}: must be one of {', '.join(map(repr, MUP_SCALES))}")


@dataclass(frozen=True)
class MatrixRules:
    """What a family that updates whole 2-D matrices (Muon) declares beside the rules every family has: the params
    it takes, its views and build check, and what its options say about fused QKV and split matrices."""

    takes: Callable[[torch.Tensor], bool]
    """As the config's family: which params it updates itself (Muon: 2-D hidden matrices); the rest go to
    ``scalar_family(config)`` (graphstep/plan/routing.py)."""
    scalar_family: Callable[[object], str]
    views: Callable[..., GroupViews]
    """views(ctx, group, segments, sources) -> whole-matrix views for ``call``."""
    check: Callable[..., None]
    """check(ctx, group): raise at build when this rank cannot hold the group's matrices whole."""
    splits_fused_qkv: Callable[[object], bool]
    """config -> whether fused QKV weights are updated as separate Q, K and V matrices."""
    updates_split_matrices_by_slice: Callable[[object], bool]
    """config -> whether a matrix split across ranks is updated slice by slice, each rank's alone, which differs
    from the update of the whole matrix (Muon's ``MuonOptions.tp_mode="blockwise"``)."""


@dataclass(frozen=True)
class Family:
    """Everything graphstep knows about one update rule. Every field without a default must be given:
    a family that forgets a rule does not get another family's by default."""

    name: str  # the value of OptimizerConfig.optimizer and of a param group's "optimizer" key
    title: str  # how messages name it ("Adam")
    fields: tuple[HyperField, ...]
    """The hyperparameters its kernel reads, in the kernel's keyword order; each a live-table column."""
    states: tuple[StateSpec, ...]  # every per-element state buffer it may keep
    validate: Callable[[object, object], None]
    """validate(config, checks): raise (through ``checks.number``/``choice``/``fail``, those of
    graphstep/config/validation.py, each given the object holding the field: the family's options, such as
    ``config.muon``, or the config) when an option or a config field it reads is out of range. Runs for
    every config, whichever family it names, as an option is a field."""
    group_defaults: Callable[[object], dict]
    """config -> the keys a param group of this family carries for it (``betas``, ``momentum``, ...),
    after the keys every group has (graphstep/plan/overrides.py)."""
    torch_defaults: Callable[[object], dict]
    """config -> the keys of ``torch.optim.Optimizer.defaults`` beside lr and weight_decay when this is
    the config's family: torch's OneCycleLR cycles ``betas`` or ``momentum`` only where defaults have it."""
    mup: MupRule
    call: Callable[..., None]  # call(kernels, views, scalars, config, grad_scale, **hyperparameters)
    offload: bool
    """Whether graphstep.offload's host update runs it (torch's fused CPU kernels exist for it)."""
    torch_shaped_groups: bool
    """As the config's ``optimizer`` with no override routing params elsewhere: True, its groups are
    ``build_param_groups``'s own, without an ``optimizer`` key (torch.optim's shape; Adam, SGD); False,
    every group names its family (graphstep/plan/routing.py)."""
    call_groups: Optional[Callable[..., None]] = None
    """call_groups(kernels, groups, scalars, config, grad_scale), ``groups`` a list of (views,
    hyperparameters): all of a step's groups of the family in one kernel call (Adam: the compiled kernel
    runs them as one loop; ``run``). None: ``call`` per group."""
    kernels: Optional[ModuleType] = None
    """The family's own kernels module, used whatever ``OptimizerConfig.kernel`` says; None: the
    configured implementation (fused, compiled, reference)."""
    entry_points: tuple[str, ...] = ()
    """With ``kernels`` None: the entry points of the configured implementation its call uses (keys of the
    implementation's ``ENTRY_POINTS``, graphstep/kernels/); the build refuses an implementation lacking one."""
    group_problem: Optional[Callable[[dict, object], Optional[str]]] = None
    """group_problem(param_group, config): what in a group's current values the built step cannot honour
    (a schedule switching on momentum the build gave no buffers for), in words; None when all is well.
    The engine asks before each step and refuses the step with it."""
    aliases: tuple[str, ...] = ()
    """Other names MuP's ``optimizer_type`` may give it (lower case): "adamw" for Adam."""
    trains_fp16: bool = True  # False: refuse fp16 params as the config's family (Megatron-Core does)
    precision_aware: bool = False
    """Whether its state may be stored below fp32 (``use_precision_aware_optimizer``: Adam's moments, as in
    Megatron-Core; graphstep/state/precision.py)."""
    main_params_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
    matrices: Optional[MatrixRules] = None
    """A family that updates whole matrices (Muon) declares them here; None: it takes every param, as flat views."""

    def __post_init__(self) -> None:
        if (self.kernels is None) != bool(self.entry_points):
            raise ValueError(f"optimizer family {self.name!r}: declare the entry points of the configured kernels "
                             "it calls (entry_points) when it has no kernels module of its own, and only then")

    @property
    def hyperparameters(self) -> tuple[tuple[str, str], ...]:
        """(kernel keyword, live-table column) per hyperparameter, in the kernel's order."""
        return tuple((field.column, field.column) for field in self.fields)

    def state_names(self, config) -> tuple[str, ...]:
        """The state buffers it keeps under ``config``."""
        return tuple(spec.name for spec in self.states if spec.needed(config))

    @property
    def views(self) -> Callable[..., GroupViews]:
        """views(ctx, group, segments, sources) -> the views ``call`` hands to the kernel."""
        return self.matrices.views if self.matrices is not None else flat_views

    @property
    def check(self) -> Optional[Callable[..., None]]:
        """check(ctx, group): raise at build when the family cannot run this group; None: it runs any."""
        return self.matrices.check if self.matrices is not None else None

    @property
    def batch_by_shape(self) -> bool:
        """Whether the family needs whole matrices: the layout then sorts its groups' params by shape so
        same-shape matrices are evenly spaced."""
        return self.matrices is not None

    def splits_fused_qkv(self, config) -> bool:
        """Whether its fused QKV weights are updated as separate Q, K and V matrices under ``config``."""
        return self.matrices is not None and self.matrices.splits_fused_qkv(config)

    def updates_split_matrices_by_slice(self, config) -> bool:
        """Whether a matrix split across ranks is updated slice by slice under ``config``; False where the update
        is the whole matrix's."""
        return self.matrices is not None and self.matrices.updates_split_matrices_by_slice(config)

    def kernels_for(self, configured: ModuleType) -> ModuleType:
        """The kernels module this family's groups run: its own, else the configured implementation."""
        return self.kernels if self.kernels is not None else configured

    def run(self, kernels: ModuleType, groups: Sequence, scalars: StepScalars, config, grad_scale) -> None:
        """The update of ``groups`` (each (views, hyperparameters)) with ``kernels`` (this family's own, or
        the configured implementation)."""
        if self.call_groups is not None:
            self.call_groups(kernels, groups, scalars, config, grad_scale)
            return
        for views, hyper in groups:
            self.call(kernels, views, scalars, config, grad_scale, **hyper)

    def live_fields(self, kernels: ModuleType) -> frozenset[str]:
        """The fields of this family that ``kernels`` reads from device tensors (the rest are baked)."""
        return frozenset(column for _, column in self.hyperparameters) & self.kernels_for(kernels).LIVE_FIELDS
