"""Which params count in the grad norm on this rank, read from Megatron-Core's parameter marks.

The norm is summed over the model-parallel group, so every element must count on exactly one rank, as
Megatron-Core's ``_get_grads_for_norm`` decides: a ``shared=True`` param on no rank (its other copy counts), a
``tensor_model_parallel`` param on every tensor-parallel rank (each holds a different slice), any other on
tensor-parallel rank 0 only. Expert params use their own expert tensor-parallel group's rank. A split param
without a tensor-parallel group is refused rather than counted per rank, and every rank checks at build that
the marks agree across the group. A param left out still takes part in the non-finite check. On plain modules
set the marks by hand: ``p.tensor_model_parallel = True; p.partition_dim = 0``, ``p.shared = True``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .experts import is_expert_param


@dataclass(frozen=True)
class NormCounting:
    """This process's rank in the tensor-parallel group of the dense params and in that of the expert
    params (0 without the group): which of its params' grads count in the grad norm and ``num_zeros``."""

    tp_rank: int = 0
    expert_tp_rank: int = 0

    def counts(self, p: torch.Tensor) -> bool:
        if getattr(p, "shared", False):
            return False
        if getattr(p, "tensor_model_parallel", False):
            return True
        return (self.expert_tp_rank if is_expert_param(p) else self.tp_rank) == 0


def resolve(named, model_parallel_group: Optional[dist.ProcessGroup],
            tensor_parallel_group: Optional[dist.ProcessGroup],
            expert_tensor_parallel_group: Optional[dist.ProcessGroup] = None
            ) -> tuple[Optional[dist.ProcessGroup], NormCounting]:
    """(the group the grad statistics are summed over besides the data-parallel one, which params count on
    this rank), after refusing marks and groups that cannot describe the model (``named``: its (name, param)
    pairs)."""
    check_groups(named, model_parallel_group, tensor_parallel_group)
    check_expert_groups(named, model_parallel_group, tensor_parallel_group, expert_tensor_parallel_group)
    for name, p in named:
        check_marks(name, p)
    check_marks_agree([(n, p) for n, p in named if not is_expert_param(p)], tensor_parallel_group,
                      "tensor-parallel")
    check_marks_agree([(n, p) for n, p in named if is_expert_param(p)], expert_tensor_parallel_group,
                      "expert tensor-parallel")
    norm_counting = NormCounting(tensor_parallel_rank(tensor_parallel_group),
                            tensor_parallel_rank(expert_tensor_parallel_group, "expert_tensor_parallel_group"))
    return model_parallel_group_of(model_parallel_group, tensor_parallel_group), norm_counting


def model_parallel_group_of(model_parallel_group: Optional[dist.ProcessGroup],
                         tensor_parallel_group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The group the grad statistics are summed over besides the data-parallel one: ``model_parallel_group``
    (tensor x pipeline), or the tensor-parallel group alone. The TP group must lie inside it."""
    if tensor_parallel_group is None:
        return model_parallel_group
    if model_parallel_group is None:
        return tensor_parallel_group
    outside = set(dist.get_process_group_ranks(tensor_parallel_group)) - set(
        dist.get_process_group_ranks(model_parallel_group))
    if outside:
        raise ValueError(f"get_optimizer: tensor_parallel_group has ranks {sorted(outside)} outside "
                         "model_parallel_group; the model-parallel group is the tensor- and pipeline-parallel "
                         "ranks together")
    return model_parallel_group


def tensor_parallel_rank(group: Optional[dist.ProcessGroup], what: str = "tensor_parallel_group") -> int:
    """This process's rank in a TP group (0 without one: every param is this rank's to count)."""
    if group is None:
        return 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"get_optimizer: this process is not a member of {what}")
    return rank


def check_marks(name: str, p: torch.Tensor) -> None:
    """Refuse a TP mark that cannot describe ``p``: a ``partition_dim`` that is not one of its dimensions."""
    if not getattr(p, "tensor_model_parallel", False):
        return
    dim = getattr(p, "partition_dim", None)
    if dim is not None and not (isinstance(dim, int) and -p.dim() <= dim < p.dim()):
        raise ValueError(f"param '{name}' is marked tensor_model_parallel with partition_dim={dim!r}, not a "
                         f"dimension of its shape {tuple(p.shape)}")


def _marked(named) -> list[str]:
    return [name for name, p in named if getattr(p, "tensor_model_parallel", False)]


def _shown(names: list[str]) -> str:
    return f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"


def check_groups(named, model_parallel_group: Optional[dist.ProcessGroup],
                 tensor_parallel_group: Optional[dist.ProcessGroup]) -> None:
    """Refuse TP-sharded params in a job of several ranks without a TP or model-parallel group (each rank
    would count its own slices alone), and summed over a model-parallel group of several ranks without the TP
    group (which ranks hold replicated copies is then unknown, and each copy would count once per TP rank)."""
    if tensor_parallel_group is None and model_parallel_group is None:
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        marked = _marked(named) if several else []
        if marked:
            raise ValueError(f"get_optimizer: params are marked tensor_model_parallel ({_shown(marked)}) and this "
                             f"process is one of {dist.get_world_size()} ranks, but no tensor_parallel_group was "
                             "given: each rank would count only its own slices in the grad norm. Pass "
                             "tensor_parallel_group (Megatron-Core's parallel_state.get_tensor_model_parallel_group(); "
                             "when the model is not tensor-parallel, a group of this rank alone: "
                             "torch.distributed.new_group([rank], use_local_synchronization=True)), or initialise "
                             "Megatron-Core's parallel_state before get_optimizer and pass no group at all: graphstep "
                             "then takes every group from it")
        return
    if tensor_parallel_group is not None or dist.get_world_size(model_parallel_group) == 1:
        return
    marked = _marked(named)
    if marked:
        raise ValueError(f"get_optimizer: params are marked tensor_model_parallel ({_shown(marked)}) and summed "
                         "over a model_parallel_group of "
                         f"{dist.get_world_size(model_parallel_group)} ranks, but no tensor_parallel_group was "
                         "given: pass it, so that the params replicated across it count on its rank 0 only (a "
                         "group of this rank alone when the model is not tensor-parallel: Megatron-Core marks "
                         "its parallel layers at any TP size)")


def _size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def check_expert_groups(named, model_parallel_group: Optional[dist.ProcessGroup],
                        tensor_parallel_group: Optional[dist.ProcessGroup],
                        expert_tensor_parallel_group: Optional[dist.ProcessGroup]) -> None:
    """Refuse expert params under a TP group of several ranks without their own TP group (which TP rank
    counts an unmarked expert param depends on it, and a guess counts it twice or not at all), an expert TP
    group without expert params, and one of several ranks with no group for the norm to be summed over."""
    experts = [name for name, p in named if is_expert_param(p)]
    if expert_tensor_parallel_group is None:
        if experts and _size(tensor_parallel_group) > 1:
            raise ValueError(f"get_optimizer: params {', '.join(experts[:3])}{', ...' if len(experts) > 3 else ''} "
                             "are expert params and tensor_parallel_group has several ranks, but no "
                             "expert_tensor_parallel_group was given: pass it (tensor_parallel_group itself when the "
                             "expert tensor-parallel size equals the tensor-parallel size, Megatron-Core's default; a "
                             "group of this rank alone when it is 1), so that each expert param counts once in the "
                             "grad norm")
        return
    if not experts:
        raise ValueError("get_optimizer: expert_tensor_parallel_group was given but no trainable param is marked "
                         "as an expert param (allreduce=False or is_expert_parallel=True)")
    if _size(expert_tensor_parallel_group) > 1 and model_parallel_group is None and tensor_parallel_group is None:
        raise ValueError("get_optimizer: expert_tensor_parallel_group has several ranks but neither "
                         "model_parallel_group nor tensor_parallel_group was given: the grad norm must be summed "
                         "over the ranks the experts are split across; pass the model-parallel group")


def same_ranks(a: Optional[dist.ProcessGroup], b: Optional[dist.ProcessGroup]) -> bool:
    """Whether two TP groups (None: this rank alone) hold the same ranks."""
    def ranks(group):
        return [dist.get_rank()] if group is None or _size(group) == 1 else dist.get_process_group_ranks(group)
    return (a is None and b is None) or ranks(a) == ranks(b)


# ---- the marks agree across the tensor-parallel group ------------------------------------------------------
_UNMARKED, _NO_DIM = -1, -2  # a param's mark code: its partition_dim (>= 0) when split


def _mark_code(p: torch.Tensor) -> int:
    if not getattr(p, "tensor_model_parallel", False):
        return _UNMARKED
    dim = getattr(p, "partition_dim", None)
    return _NO_DIM if dim is None else dim % p.dim()


def _describe_mark(code: int) -> str:
    if code == _UNMARKED:
        return "not tensor_model_parallel"
    return "tensor_model_parallel" + ("" if code == _NO_DIM else f" with partition_dim={code}")


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "little")  # fits int64


def _all_gather(values: list[int], group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def check_marks_agree(named, group: Optional[dist.ProcessGroup], kind: str) -> None:
    """Refuse marks that differ across ``group`` (a ``kind`` TP group): each rank would count a param by its own
    marks, and the norm (or Muon's gather) would mix them. Collective over ``group`` at build: one all-gather of
    a digest of the params' names and marks; only when they differ, a second one of each param's, to name it.
    Without the group, or with one rank, nothing to compare."""
    if group is None or dist.get_world_size(group) == 1:
        return
    # The exchange runs on the group's backend: gloo on the host, NCCL on the params' device.
    device = torch.device("cpu") if "gloo" in str(dist.get_backend(group)) or not named else named[0][1].device
    entries = [(_name_hash(name), _mark_code(p)) for name, p in named]
    digest = hashlib.sha256(repr(entries).encode()).digest()
    gathered = _all_gather([len(entries), int.from_bytes(digest[:7], "little"), int.from_bytes(digest[7:14], "little")],
                           group, device)
    if all(theirs == gathered[0] for theirs in gathered):
        return
    rank = dist.get_rank(group)
    counts = [theirs[0] for theirs in gathered]
    if len(set(counts)) > 1:
        raise ValueError(f"get_optimizer: the {kind} ranks hold different numbers of trainable params ({counts}, "
                         f"by rank; this is rank {rank}): every rank of the {kind} group must hold the same params, "
                         "each its own slice of the split ones")
    flat = _all_gather([value for entry in entries for value in entry], group, device)
    per_rank = [list(zip(values[0::2], values[1::2])) for values in flat]
    for other, theirs in enumerate(per_rank):
        for i, ((name, _), (first_hash, first_code), (their_hash, their_code)) in enumerate(
                zip(named, per_rank[0], theirs)):
            if first_hash != their_hash:
                raise ValueError(f"get_optimizer: the {kind} ranks hold different params: param #{i} is "
                                 f"'{named[i][0]}' on this rank ({rank}), and {kind} ranks 0 and {other} differ "
                                 "there; every rank of the group must hold the same params in the same order")
            if first_code != their_code:
                raise ValueError(f"get_optimizer: the {kind} ranks disagree on the marks of param '{name}': "
                                 f"{_describe_mark(first_code)} on {kind} rank 0, {_describe_mark(their_code)} on "
                                 f"rank {other}. Mark it the same way on every rank (Megatron-Core's layers do): "
                                 "each rank would otherwise count it by its own marks in the grad norm")
