"""Which param each entry of torch's optimizer format is, and where its elements lie: per param of every domain,
its place in the layout, its tensor-parallel slice of the whole param, and the ranges and ranks that hold it.

torch's functions key the state by the model's param names, so a checkpoint is only right where one name means
one tensor on every rank that uses it. This module refuses, before anything is saved or loaded, the models where
it does not: expert params that different expert-parallel ranks name alike, pipeline stages (each lists its own
params under the same group keys), and expert params split over a tensor-parallel group in the dense layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from .param_pieces import RankGrid, SliceOfWhole, group_ranks, ownership, slice_of_whole

@dataclass(frozen=True)
class ParamEntry:
    """One param's entry: ``domain`` and its ``place`` in the domain's layout, ``where`` its slice lies in the
    whole param, this rank's ``mine`` (an OwnedRange, or None), and every (data-parallel rank, OwnedRange) of it
    (``owners``). ``grid``: the global ranks of the domain's (tensor-parallel, data-parallel) places, where
    entries are built (None when only validating)."""

    domain: Any
    place: Any
    where: SliceOfWhole
    mine: Any
    owners: list
    grid: Optional[RankGrid]

    @property
    def sharded(self) -> bool:
        """Saved as a ShardedTensor (pieces of the whole param), not a plain tensor of all of it."""
        return (self.domain.layout.dp_size > 1 and not self.scalar) or self.where.split

    @property
    def scalar(self) -> bool:
        """A 0-d param: one data-parallel rank owns it, and a ShardedTensor of no dims has no empty piece for the
        others (``param_pieces.sharded_param``): every rank saves the owner's value, plain."""
        return not self.where.shape

    def owner_rank(self) -> int:
        """The global rank of the data-parallel rank that owns a 0-d param."""
        return self.grid.holders(self.where, self.where.part)[self.owners[0][0]]


def param_entries(domains: tuple, what: str, *, with_grid: bool) -> dict[int, ParamEntry]:
    """id(param) -> its entry, for every param of an optimizer's ``domains`` (the dense one first); refuses the
    models above (collective: every rank of the optimizer calls it, as torch's functions are called)."""
    refuse_pipeline_stages(domains[0].comm, what)
    out = {}
    for domain in domains:
        comm, layout = domain.comm, domain.layout
        split_elsewhere = getattr(comm, "experts_split_elsewhere", frozenset())
        grid = RankGrid.of(group_ranks(comm.dp_group if layout.dp_size > 1 else None, layout.dp_size),
                           comm.tp_group) if with_grid else None
        mine = {o.param: o for o in layout.owned_ranges(domain.rank)}
        owners = ownership(layout)
        for place, p in zip(layout.params, domain.buffers.params):
            if place.name in split_elsewhere and getattr(p, "tensor_model_parallel", False):
                raise NotImplementedError(
                    f"{what}: expert param '{place.name}' is split over an expert_tensor_parallel_group and shares "
                    "the dense params' layout (one data-parallel rank, no expert_data_parallel_group), so where its "
                    "other slices lie is not known here: pass expert_data_parallel_group (a group of this rank "
                    "alone) to give the experts their own layout, or save each rank's opt.state_dict() with "
                    "torch.save")
            where = slice_of_whole(p, place.name, comm.tp_size, comm.tp_rank)
            out[id(p)] = ParamEntry(domain, place, where, mine.get(place.index), owners[place.index], grid)
    refuse_shared_expert_names(domains, what)
    return out


def refuse_pipeline_stages(comm, what: str) -> None:
    """Refuses pipeline stages: a model-parallel group beyond the tensor-parallel one (``comm``: the dense
    params' collectives)."""
    mp_group = comm.mp_group
    mp_size = 1 if mp_group is None else dist.get_world_size(mp_group)
    if mp_size > comm.tp_size:
        raise NotImplementedError(
            f"{what}: the model is split into pipeline stages (a model_parallel_group of {mp_size} ranks, beyond "
            f"the tensor-parallel group of {comm.tp_size}). Each stage's param_groups list its own params "
            "under the same keys ('param_groups.0.params', ...), and DCP saves one rank's copy of such an entry, "
            "so the other stages' groups could not be found at load (and stages that number their layers from 0 "
            "share param names). Tensor parallelism alone works (pass tensor_parallel_group, no pipeline "
            "ranks); with pipeline stages save each rank's opt.state_dict() with torch.save and load it with "
            "opt.load_state_dict()")


def expert_parallel_size(domains: tuple) -> int:
    """How many expert-parallel ranks share a pipeline stage: its ranks (data- times tensor-parallel) over
    those holding the same experts (expert data- times expert tensor-parallel); 1 without experts."""
    dense, experts = domains[0], domains[1:]
    if not experts:
        return 1
    stage = dense.layout.dp_size * dense.comm.tp_size
    same = experts[0].layout.dp_size * experts[0].comm.tp_size
    return max(1, stage // same)


def _gather(group, value) -> list:
    if group is None or dist.get_world_size(group) == 1:
        return [value]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def refuse_shared_expert_names(domains: tuple, what: str) -> None:
    """With several expert-parallel ranks, no expert param name on two ranks that hold different experts.
    Collective over the stage's ranks (the dense data-parallel group, then the tensor-parallel group)."""
    if expert_parallel_size(domains) == 1:
        return
    dense, experts = domains[0], domains[1]
    me = dist.get_rank()
    mine = {"rank": me,
            "expert_dp": group_ranks(experts.comm.dp_group if experts.layout.dp_size > 1 else None,
                                     experts.layout.dp_size),
            "expert_tp": group_ranks(experts.comm.tp_group, 1),
            "names": sorted(place.name for place in experts.layout.params)}
    dp_group = dense.comm.dp_group if dense.layout.dp_size > 1 else None
    stage = [info for row in _gather(dense.comm.tp_group, _gather(dp_group, mine)) for info in row]
    by_rank = {info["rank"]: info for info in stage}
    same_experts = {r for peer in mine["expert_tp"] if peer in by_rank for r in by_rank[peer]["expert_dp"]}
    same_experts |= set(mine["expert_tp"]) | {me}
    names = set(mine["names"])
    for info in stage:
        if info["rank"] in same_experts:
            continue
        shared = sorted(names & set(info["names"]))
        if shared:
            raise ValueError(
                f"{what}: expert param '{shared[0]}' has the same name on global ranks {me} and {info['rank']}, "
                "which hold different experts (expert parallelism): torch's checkpoint API keys the model's and "
                "the optimizer's state by param name, so one expert would overwrite the other in a DCP checkpoint. "
                "Name each expert by its global index (e.g. a ModuleDict keyed by it), so that one name is one "
                "expert on every rank (a load at another expert-parallel size then finds it too), or save each "
                "rank's opt.state_dict() with torch.save")
