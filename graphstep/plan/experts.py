"""Expert params of MoE models: their own layout, sharded over the expert data-parallel group.

Megatron-Core's convention marks an expert param with ``allreduce=False`` (or ``is_expert_parallel=True``):
different expert-parallel ranks hold *different* experts, so their grads must never be averaged over the
full data-parallel group. Only the ranks that hold the same experts (the expert data-parallel group, of
size dp·tp / (ep·etp)) share them. graphstep gives those params a *domain* of their own
(graphstep/step/domains.py): a Layout planned with the expert data-parallel size, its own StaticBuffers and its
own Collectives over that group. The step stays one chain of stages (one graph): reduce-scatter, update,
copy-back and all-gather run once per domain; the norm, the non-finite check, the clip and the skip
decision run once, over both.

Three rules, each with its reason:

1. **Averaging.** An expert's grad on one rank already holds contributions from the tokens of every rank
   of its expert-parallel group (the token all-to-all of the forward sends them there, and its backward
   sends the grads back). Summing it over the expert data-parallel group therefore sums over every
   data-parallel rank's tokens, so the average of the global loss divides that sum by the *full*
   data-parallel size, not by the expert data-parallel size. Megatron-Core does the same
   (``expert_gradient_scaling_factor = 1 / dp_size`` in its DistributedDataParallel, or edp/dp before an
   AVG over the expert group). Here: SUM reduce-scatter over the expert group, times 1/dp. With an expert
   data-parallel size of 1 there is no collective, only the times 1/dp (``step/stages/reduce.local_average``).

2. **The global grad norm and the non-finite check.** After the reduce-scatters each rank holds one shard
   of the dense grads (a partition of them over the data-parallel group) and one shard of its experts'
   grads (a partition of its experts over the expert data-parallel group; other expert-parallel ranks
   hold the other experts). So across the ranks of the data-parallel group (times the model-parallel
   group, when one is given) every dense element and every expert element is held by exactly one rank.
   Each rank adds its dense and its expert sums of squares into *one* value, and the existing SUM
   all-reduce over the data-parallel (then model-parallel) group yields the global norm: one collective,
   the same number on every rank. A non-finite expert grad makes that sum non-finite on every rank, so
   every rank skips. This needs each expert data-parallel group to lie inside that grid of ranks: with
   no model-parallel group, inside the data-parallel group (checked at build); with one, the grid is taken
   to be the whole job (not checked: the model-parallel layout is the caller's). Megatron-Core (one
   optimizer per kind of param, chained) does the same when their grad-stats groups coincide (the whole
   job, with the distributed optimizer): one norm over all their grads; otherwise it combines the
   optimizers' norms as the root of their squares' sum on the host (its ChainedOptimizer).

3. **Which params are expert params.** ``allreduce=False`` or ``is_expert_parallel=True``. On one process
   (no data-parallel ranks, and no expert group of more than one rank) they simply join the dense layout:
   there is nothing to average, and the math is the same. With several data-parallel ranks and no
   ``expert_data_parallel_group`` they are refused rather than averaged with other ranks' different
   experts (silently wrong); pass the expert data-parallel group (``process_group`` itself when the
   expert-parallel size is 1).

Checkpoints: ``opt.state_dict()`` (exact, per rank, same layout) holds the expert domain under ``"experts"``;
the reshardable format refuses it (``domains.refuse_checkpoint``). ``overlap_grad_reduce`` and
``overlap_param_gather`` hook the expert collectives as well (graphstep.overlap.Overlaps). Muon on experts
(their layout is planned like the dense one, layer-wise for Muon's groups) is tested under tensor parallelism
(tests/distributed/test_tensor_parallel_experts.py). Not yet tested: fp8 expert weights (the requantize stage
runs per domain; the flat checkpoint's fp8 entry covers the dense domain only). Not supported: QK-clip on
expert weights (its registered weights must be dense). Under tensor parallelism the expert params are split
over their own expert tensor-parallel group, which decides which rank counts their copies
(graphstep/plan/model_parallel.py) and which group Muon's split expert matrices use.
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
