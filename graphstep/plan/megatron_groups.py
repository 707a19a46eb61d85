"""Megatron-Core's process groups for ``get_optimizer`` when the caller passed none.

Megatron's tensor-parallel marks say nothing about *which* ranks hold a param's other slices: that is its
``parallel_state``. Built without groups, such a model would count every rank's slices alone in the grad norm.
So when no group at all is passed, Megatron-Core is imported with its parallel state initialised and a trainable
param carries its tensor-parallel mark, graphstep takes the groups Megatron-Core's own optimizer uses and says
so in one warning. Some groups given and others not is the caller's layout: nothing is added. graphstep never
imports Megatron-Core: it reads ``sys.modules``.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Optional

import torch.distributed as dist

from ..config.warn import warn_user
from .experts import is_expert_param

PARALLEL_STATE = "megatron.core.parallel_state"

GROUP_ARGUMENTS = ("process_group", "model_parallel_group", "expert_data_parallel_group", "tensor_parallel_group",
                   "expert_tensor_parallel_group")
"""``get_optimizer``'s group arguments, in its order."""


def initialised_parallel_state() -> Optional[ModuleType]:
    """Megatron-Core's ``parallel_state`` module when this process imported it and initialised its model-parallel
    groups, else None."""
    state = sys.modules.get(PARALLEL_STATE)
    if state is None or not dist.is_available() or not dist.is_initialized():
        return None
    initialised = getattr(state, "model_parallel_is_initialized", None)
    return state if initialised is not None and initialised() else None


def is_megatron_model(named) -> bool:
    """Whether a trainable param carries Megatron-Core's tensor-parallel attribute (its parallel layers set it at
    any tensor-parallel size; ``set_defaults_if_not_set_tensor_model_parallel_attributes`` sets it False)."""
    return any(hasattr(p, "tensor_model_parallel") for _, p in named)


def _ranks(group) -> str:
    ranks = dist.get_process_group_ranks(group)
    return str(ranks if len(ranks) <= 8 else ranks[:4] + ["..."] + ranks[-2:])


def from_parallel_state(config, named) -> dict:
    """The groups to build with ({argument: group}; empty when there is no initialised ``parallel_state`` or the
    model is not Megatron-Core's), warning once which were taken. ``named``: the model's trainable params."""
    state = initialised_parallel_state()
    if state is None or not is_megatron_model(named):
        return {}
    distributed = config.use_distributed_optimizer
    experts = any(is_expert_param(p) for _, p in named)
    if experts and not distributed and state.get_expert_model_parallel_world_size() > 1:
        raise ValueError("get_optimizer: the model has expert params spread over Megatron-Core's "
                         f"{state.get_expert_model_parallel_world_size()} expert-parallel ranks but "
                         "use_distributed_optimizer=False: the grad norm would miss the other ranks' experts; set "
                         "use_distributed_optimizer=True (graphstep then takes the expert data-parallel group)")
    groups = {"tensor_parallel_group": state.get_tensor_model_parallel_group()}
    model_parallel = state.get_model_parallel_group()
    if dist.get_world_size(model_parallel) > 1:
        groups["model_parallel_group"] = model_parallel
    if distributed:
        groups["process_group"] = state.get_data_parallel_group(with_context_parallel=True)
    if experts:
        groups["expert_tensor_parallel_group"] = state.get_expert_tensor_parallel_group()
        if distributed:
            groups["expert_data_parallel_group"] = state.get_expert_data_parallel_group()
    taken = ", ".join(f"{name} (ranks {_ranks(groups[name])})" for name in GROUP_ARGUMENTS if name in groups)
    warn_user(f"graphstep: get_optimizer was given no process groups; it took them from Megatron-Core's "
              f"initialised parallel_state: {taken}. Pass the groups to get_optimizer to choose others",
              UserWarning)
    return groups
