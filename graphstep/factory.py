"""``get_optimizer``: the engine for a model, picked by its params: graphstep/engine.py's for plain (and
Megatron-style tensor-parallel) models, graphstep/fsdp2/optimizer.py's for FSDP2 models (DTensor params)."""

from __future__ import annotations

from .plan import megatron_groups
from .plan.model_params import is_dtensor, named_trainable_params
from .config import OptimizerConfig
from .engine import GraphstepOptimizer
from .fsdp2.optimizer import Fsdp2Optimizer


def get_optimizer(config: OptimizerConfig, model_chunks, config_overrides=None, process_group=None,
                  model_parallel_group=None, expert_data_parallel_group=None,
                  tensor_parallel_group=None, expert_tensor_parallel_group=None) -> GraphstepOptimizer:
    """Build the engine over ``model_chunks`` (an nn.Module or a list of them).

    ``config_overrides``: None applies the standard overrides (no weight decay on biases and 1-D params,
    ``decoupled_lr`` for embedding/output params); ``{}`` applies none. ``process_group``: the
    data-parallel group (default WORLD when torch.distributed is initialised and the distributed optimizer
    is on). ``model_parallel_group``: summed over as well for the grad norm and the non-finite check (the
    tensor- and pipeline-parallel ranks together). ``expert_data_parallel_group``: the group MoE expert params
    (marked ``allreduce=False`` or ``is_expert_parallel=True``) are sharded and reduced over instead of
    ``process_group``; see graphstep/plan/experts.py for the rules. ``tensor_parallel_group``: the
    tensor-parallel group, whose rank 0 alone counts the params replicated across it in the grad norm
    (graphstep/plan/model_parallel.py); it is the model-parallel group too when that is not given.
    ``expert_tensor_parallel_group``: the same for the expert params (Megatron-Core's expert tensor-parallel
    group); needed with expert params and a tensor-parallel group of several ranks.

    Given no group at all, a Megatron-Core model (its params carry ``tensor_model_parallel``) in a process that
    initialised Megatron-Core's ``parallel_state`` takes its groups from there, with a warning naming them
    (graphstep/plan/megatron_groups.py). Params marked tensor-parallel on several ranks without a
    tensor-parallel (or model-parallel) group are refused.

    An FSDP2 model (``fully_shard``: DTensor params) takes none of the groups: they come from its device mesh.
    """
    given = {"process_group": process_group, "model_parallel_group": model_parallel_group,
             "expert_data_parallel_group": expert_data_parallel_group,
             "tensor_parallel_group": tensor_parallel_group,
             "expert_tensor_parallel_group": expert_tensor_parallel_group}
    named = named_trainable_params(model_chunks, dtensors=True)
    if any(is_dtensor(p) for _, p in named):
        passed = [name for name, group in given.items() if group is not None]
        if passed:
            raise ValueError(f"get_optimizer: {', '.join(passed)} given with an FSDP2 model: graphstep reads the "
                             "groups from the params' device mesh")
        return Fsdp2Optimizer(config, model_chunks, config_overrides)
    if isinstance(config, OptimizerConfig) and all(group is None for group in given.values()):
        given.update(megatron_groups.from_parallel_state(config, named))
    return GraphstepOptimizer(config, model_chunks, config_overrides, **given)
