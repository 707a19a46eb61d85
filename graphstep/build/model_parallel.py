"""Which params count in the grad norm on this rank, read from Megatron-Core's parameter marks.

With tensor parallelism (TP) a param is either sharded over the TP group (Megatron marks it
``tensor_model_parallel=True``, with the dimension it is split along in ``partition_dim``), each rank holding
its own slice, or replicated on every TP rank (LayerNorm weights, row-parallel biases: unmarked). With
pipeline parallelism the first and last stages can hold one embedding between them; the last stage's copy is
marked ``shared=True``. The norm is summed over the model-parallel group, so every element must be counted
on exactly one rank, as Megatron-Core's ``_get_grads_for_norm`` does (``param_is_not_shared`` and
``param_is_not_tensor_parallel_duplicate``):

- a param marked ``shared=True`` is counted on no rank (its other copy is);
- a TP-sharded param is counted on every TP rank (each holds a different slice);
- any other param is counted on TP rank 0 only.

A param left out still takes part in the non-finite check (graphstep/step/stages/norm.py): a NaN in it skips
the step on every rank. The same rule leaves it out of ``num_zeros``. On plain ``nn.Module``s set the marks
the same way: ``p.tensor_model_parallel = True; p.partition_dim = 0`` (or 1), ``p.shared = True``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def resolve(named, model_parallel_group: Optional[dist.ProcessGroup],
            tensor_parallel_group: Optional[dist.ProcessGroup]) -> tuple[Optional[dist.ProcessGroup], int]:
    """(the group the grad statistics are summed over besides the data-parallel one, this rank's TP rank),
    after refusing marks and groups that cannot describe the model (``named``: its (name, param) pairs)."""
    check_groups(named, model_parallel_group, tensor_parallel_group)
    for name, p in named:
        check_marks(name, p)
    return model_parallel_group_of(model_parallel_group, tensor_parallel_group), tensor_parallel_rank(
        tensor_parallel_group)


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


def tensor_parallel_rank(tensor_parallel_group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank in the TP group (0 without one: every param is this rank's to count)."""
    if tensor_parallel_group is None:
        return 0
    rank = dist.get_rank(tensor_parallel_group)
    if rank < 0:
        raise ValueError("get_optimizer: this process is not a member of tensor_parallel_group")
    return rank


def check_marks(name: str, p: torch.Tensor) -> None:
    """Refuse a TP mark that cannot describe ``p``: a ``partition_dim`` that is not one of its dimensions."""
    if not getattr(p, "tensor_model_parallel", False):
        return
    dim = getattr(p, "partition_dim", None)
    if dim is not None and not (isinstance(dim, int) and -p.dim() <= dim < p.dim()):
        raise ValueError(f"param '{name}' is marked tensor_model_parallel with partition_dim={dim!r}, not a "
                         f"dimension of its shape {tuple(p.shape)}")


def check_groups(named, model_parallel_group: Optional[dist.ProcessGroup],
                 tensor_parallel_group: Optional[dist.ProcessGroup]) -> None:
    """Refuse TP-sharded params summed over a model-parallel group of several ranks without the TP group:
    which ranks hold replicated copies is then unknown, and each copy would count once per TP rank."""
    if tensor_parallel_group is not None or model_parallel_group is None or dist.get_world_size(
            model_parallel_group) == 1:
        return
    marked = [name for name, p in named if getattr(p, "tensor_model_parallel", False)]
    if marked:
        raise ValueError(f"get_optimizer: params are marked tensor_model_parallel ({', '.join(marked[:3])}"
                         f"{', ...' if len(marked) > 3 else ''}) and summed over a model_parallel_group of "
                         f"{dist.get_world_size(model_parallel_group)} ranks, but no tensor_parallel_group was "
                         "given: pass it, so that the params replicated across it count on its rank 0 only (a "
                         "group of this rank alone when the model is not tensor-parallel: Megatron-Core marks "
                         "its parallel layers at any TP size)")


def check_experts(has_expert_domain: bool, tensor_parallel_group: Optional[dist.ProcessGroup]) -> None:
    """Refuse expert params together with a tensor-parallel group of several ranks: which TP rank counts an
    expert's grads (with expert tensor parallelism or without) is not settled here yet, and a guess could
    count them twice or not at all."""
    if has_expert_domain and tensor_parallel_group is not None and dist.get_world_size(tensor_parallel_group) > 1:
        raise ValueError("get_optimizer: expert params (an expert_data_parallel_group domain) together with a "
                         "tensor_parallel_group of several ranks are not supported yet: their grads could be "
                         "counted in the norm once per tensor-parallel rank")


def counted_in_norm(p: torch.Tensor, tp_rank: int) -> bool:
    """Whether ``p``'s grad counts in the grad norm (and ``num_zeros``) on TP rank ``tp_rank``."""
    if getattr(p, "shared", False):
        return False
    return bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0
