"""Expert params of MoE models: their own layout, sharded over the expert data-parallel group.

Expert params (``allreduce=False`` or ``is_expert_parallel=True``, Megatron-Core's marks) differ between
expert-parallel ranks, so they get a *domain* of their own (graphstep/step/domains.py): a layout, buffers and
collectives over the expert data-parallel group, inside the same one-graph step. Their grads are summed over
that group and divided by the *full* data-parallel size, as Megatron-Core does: the token all-to-all already put
every expert-parallel rank's tokens into each expert's grad. The grad norm and the non-finite check add dense
and expert sums into one all-reduce, so every element counts once and all ranks skip together; this needs each
expert group inside the data-parallel grid (checked at build without a model-parallel group). On one process
expert params join the dense layout; with several ranks and no ``expert_data_parallel_group`` they are refused
rather than silently averaged with other ranks' different experts. The reshardable checkpoint refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..parallel.collectives import derive_group


def is_expert_param(p: torch.Tensor) -> bool:
    """Megatron-Core's marks of an expert param: ``allreduce=False`` or ``is_expert_parallel=True``."""
    return getattr(p, "allreduce", True) is False or bool(getattr(p, "is_expert_parallel", False))


@dataclass(frozen=True)
class ExpertGroup:
    """The expert data-parallel group the expert domain is sharded over (graphstep's own copy with the
    configured timeout when it has several ranks), this rank's place in it, the full data-parallel size the
    expert grads are averaged by (rule 1), and the expert tensor-parallel group Muon's split expert matrices
    are gathered over (graphstep/plan/model_parallel.py)."""

    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    average_over: int
    tensor_parallel_group: Optional[dist.ProcessGroup] = None


def expert_group(config, named, expert_indices: list[int], expert_data_parallel_group,
                 dp_group: Optional[dist.ProcessGroup], dp_size: int, model_parallel_group,
                 expert_tensor_parallel_group: Optional[dist.ProcessGroup] = None) -> Optional[ExpertGroup]:
    """The expert domain's group, or None when the expert params (if any) join the dense layout.

    Validates the combination and raises ValueError saying what to pass instead. Creating graphstep's copy
    of the group is collective over its members (like the data-parallel group's: build on all of them).
    """
    names = [named[i][0] for i in expert_indices]
    if expert_data_parallel_group is None:
        if names and dp_size > 1:
            shown = ", ".join(f"'{n}'" for n in names[:3]) + (", ..." if len(names) > 3 else "")
            raise ValueError(f"params {shown} are marked as expert params (allreduce=False or "
                             "is_expert_parallel=True) but no expert_data_parallel_group was given: graphstep would "
                             "average them over the whole data-parallel group, mixing different ranks' experts. Pass "
                             "get_optimizer(..., expert_data_parallel_group=...) (process_group itself when the "
                             "expert-parallel size is 1), or clear the marks")
        return None
    if not config.use_distributed_optimizer:
        raise ValueError("expert_data_parallel_group needs use_distributed_optimizer=True: graphstep reduces "
                         "grads (dense and expert) only with the distributed optimizer")
    if not dist.is_initialized():
        raise ValueError("expert_data_parallel_group was given but torch.distributed is not initialised: call "
                         "torch.distributed.init_process_group first")
    if expert_data_parallel_group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(expert_data_parallel_group) < 0:
        raise ValueError(f"get_optimizer: this process (global rank {dist.get_rank()}) is not a member of "
                         "expert_data_parallel_group; pass the expert data-parallel group this rank belongs to")
    if not names:
        raise ValueError("expert_data_parallel_group was given but no trainable param is marked as an expert param: "
                         "mark the expert params with allreduce=False (Megatron-Core's convention) or "
                         "is_expert_parallel=True, or drop the group")
    if len(expert_indices) == len(named):
        raise ValueError("every trainable param is an expert param: graphstep needs at least one dense param "
                         "(router, attention, embeddings) next to the experts")
    rank, size = dist.get_rank(expert_data_parallel_group), dist.get_world_size(expert_data_parallel_group)
    if model_parallel_group is None:
        dense_ranks = set(dist.get_process_group_ranks(dp_group)) if dp_group is not None else {dist.get_rank()}
        expert_ranks = dist.get_process_group_ranks(expert_data_parallel_group)
        outside = sorted(set(expert_ranks) - dense_ranks)
        if outside:
            raise ValueError(f"expert_data_parallel_group (global ranks {expert_ranks}) holds ranks {outside} outside "
                             f"the data-parallel group (global ranks {sorted(dense_ranks)}): the global grad norm "
                             "sums every expert shard over the data-parallel group, so each expert data-parallel "
                             "group must lie inside it (or pass the model_parallel_group that spans the rest)")
    if size == 1 and dp_size == 1 and expert_tensor_parallel_group is None:
        return None  # one rank holds all of its experts and averages over nobody: the dense layout is exact
    group = derive_group(expert_data_parallel_group, config.distributed_timeout_s) if size > 1 else None
    return ExpertGroup(group, rank if size > 1 else 0, size, dp_size, expert_tensor_parallel_group)
