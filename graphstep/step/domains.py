"""Sharding domains: sets of params with their own layout, buffers, collectives and step context.

The dense params form the first domain, sharded over the data-parallel group. MoE expert params, when
there are some to keep apart (graphstep/plan/experts.py says when and why), form a second one over the expert
data-parallel group. Both are instances of ``Domain``; what tells them apart is data, a ``Role`` (the
names of their stages and guarded buffers, where their checkpoint entries sit, whether the reshardable
format covers them), so the code that runs over them — the step's chain (graphstep/step/stages), the state
dict, memory stats, the overlap hooks, the debugger — iterates ``opt.domains`` instead of asking whether
there are experts. The first domain's context holds the step scalars every domain shares (same
``StepTensors``, hyperparameters and scaler).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ..plan import experts as expert_rules

if TYPE_CHECKING:
    from ..plan.layout import Layout
    from ..parallel.collectives import Collectives
    from ..state.buffers import StaticBuffers
    from .stages import Stage
    from .stages.context import StepContext


@dataclass(frozen=True)
class Role:
    """What differs between domains: names and places, never behaviour."""

    name: str
    stage_prefix: str  # a stage's name in the chain (profiler ranges, the debugger's table): prefix + name
    address_prefix: str  # a static buffer's name in a capture's guard messages: prefix + name
    checkpoint_path: tuple[str, ...]  # where ``opt.state_dict()`` holds its entries: () is the top level
    layout_mismatch: str  # why a flat checkpoint's layout fingerprint does not match, and what to do
    rank_mismatch: str  # the same for its rank; ``{saved}`` and ``{rank}`` are filled in
    unreshardable: Optional[str] = None  # why the reshardable format refuses it, and what to use; None: covered


DENSE = Role(
    "dense", "", "", (),
    layout_mismatch="was saved for a different layout (other params, groups, dtypes, bucket size or "
                    "data-parallel size): build the optimizer over the same model and config, or use "
                    "graphstep.checkpoint to reshard",
    rank_mismatch="is {saved!r:.30}: checkpoint of another rank loaded on rank {rank}")

EXPERTS = Role(
    "experts", "expert_", "expert ", ("experts",),
    layout_mismatch="was saved for a different expert layout (other expert params, bucket size or expert "
                    "data-parallel size): build the optimizer alike",
    rank_mismatch="is {saved!r:.30}: another expert data-parallel rank's checkpoint",
    # Its entries are keyed by param name, and an expert's name is local to its expert-parallel rank (rank 0's
    # ``experts.0`` is not rank 1's), so two different experts would meet under one key; its JSON entries
    # (groups, metadata) are saved once, for all ranks, while the expert params differ between them.
    unreshardable="does not cover expert params (expert_data_parallel_group) yet: their names are local to "
                  "each expert-parallel rank. Use opt.state_dict() / opt.load_state_dict() (exact, per rank, "
                  "same layout), which include the expert params' state")


@dataclass(frozen=True)
class Domain:
    """One domain's layout, buffers and collectives, and the step context its stages build from (which
    also holds its folded sums of squares, ``ctx.folded``, and the size its grads average over)."""

    role: Role
    layout: "Layout"
    buffers: "StaticBuffers"
    comm: "Collectives"
    ctx: "StepContext"

    @property
    def rank(self) -> int:
        """This rank's place in the domain's group (what its shard ranges are planned for)."""
        return self.ctx.rank

    def named(self, stage: "Stage") -> "Stage":
        """``stage`` under the domain's name, so profiler ranges and the debugger's table tell domains apart."""
        return dataclasses.replace(stage, name=self.role.stage_prefix + stage.name)

    def addresses(self) -> dict:
        """The domain's static buffers by name (what a capture guards), prefixed by the role."""
        return {self.role.address_prefix + name: t for name, t in self.buffers.addresses().items()}


@dataclass(frozen=True)
class ExpertDomainPlan:
    """A domain beside the dense one, planned but not built: its params (indices into the named params) and
    the group it is sharded over."""

    role: Role
    indices: list[int]
    group: expert_rules.ExpertGroup


def plan(config, named: Sequence[tuple[str, torch.nn.Parameter]], expert_data_parallel_group, dp_group,
         dp_size: int, model_parallel_group, expert_tensor_parallel_group=None) -> tuple[list[int], list[ExpertDomainPlan]]:
    """(the dense params' indices into ``named``, the expert domains). Without an expert domain every param
    is dense and there is no expert domain. Validates as ``experts.expert_group`` does."""
    experts = [i for i, (_, p) in enumerate(named) if expert_rules.is_expert_param(p)]
    group = expert_rules.expert_group(config, named, experts, expert_data_parallel_group, dp_group, dp_size,
                                      model_parallel_group, expert_tensor_parallel_group)
    if group is None:  # the expert params (if any) join the dense layout: the math is the same
        return list(range(len(named))), []
    expert_set = set(experts)
    return [i for i in range(len(named)) if i not in expert_set], [ExpertDomainPlan(EXPERTS, experts, group)]


def build_expert_domain(dense: Domain, plan: ExpertDomainPlan, specs, params, *, device, state_names) -> Domain:
    """Plan, allocate and agree on an expert domain (the build-time layout check runs over its group): the
    dense context with its own layout, buffers, collectives, rank, averaging size and folded sums."""
    from ..plan.layout import plan_layout
    from ..parallel.collectives import Collectives
    from ..state.allocation import allocate
    from ..state.precision import main_compute_dtype, main_storage, storage_by_state
    from . import folded_sums

    config, group = dense.ctx.config, plan.group
    specs = [specs[i] for i in plan.indices]
    layout = plan_layout(specs, group.size, config.bucket_size)
    buffers = allocate(layout, [params[i] for i in plan.indices], rank=group.rank, device=device,
                       main_dtype=main_compute_dtype(config), state_names=state_names,
                       group_states=[family.state_names(config) for family in dense.ctx.families],
                       state_storage=storage_by_state(config, state_names), main_storage=main_storage(config))
    comm = Collectives(group.group, group.size, None, timeout_s=config.distributed_timeout_s,
                       tp_group=group.tensor_parallel_group)
    comm.setup(layout, config, device)
    # Its grads become final in the step (its reduce-scatter or local average), which folds their norm.
    folded = folded_sums.plan(config, layout, buffers, hooked=False)
    ctx = dataclasses.replace(dense.ctx, layout=layout, buffers=buffers, comm=comm, rank=group.rank,
                              average_over=group.average_over, folded=folded)
    return Domain(plan.role, layout, buffers, comm, ctx)


def with_role(domains: Sequence[Domain], role: Role) -> Optional[Domain]:
    """The domain playing ``role``, or None (``opt.experts``, a convenience for tests and tools)."""
    return next((domain for domain in domains if domain.role is role), None)


def refuse_checkpoint(view, what: str) -> None:
    """The reshardable format refuses an optimizer with a domain it does not cover, rather than save half
    an optimizer, and one whose model is split over model-parallel ranks: it names state by param, and the
    tensor-parallel slices and pipeline stages of one param name share the name, so their entries would
    overwrite each other in one checkpoint. ``view``: the optimizer's ``CheckpointView``."""
    if view.local_shards is not None:  # an FSDP2 model's optimizer
        raise TypeError(f"{what}: an FSDP2 model's optimizer checkpoints through torch.distributed.checkpoint: "
                        "get_state_dict(model, opt) / set_state_dict(model, opt, ...) with dcp.save / dcp.load, or "
                        "opt.state_dict() (torch's format)")
    mp_groups = [d.comm.mp_group for d in view.domains if d.comm.mp_group is not None]
    if any(torch.distributed.get_world_size(group) > 1 for group in mp_groups):
        raise NotImplementedError(f"{what}: the reshardable checkpoint format (graphstep.checkpoint) names state by "
                                  "param, and with a model_parallel_group of several ranks the tensor-parallel slices "
                                  "and pipeline stages share param names, so one rank's entries would overwrite "
                                  "another's: save each rank's opt.state_dict() (torch.save to a per-rank file) "
                                  "instead")
    for domain in view.domains:
        if domain.role.unreshardable is not None:
            raise NotImplementedError(f"{what}: the reshardable checkpoint format (graphstep.checkpoint) "
                                      f"{domain.role.unreshardable}")
