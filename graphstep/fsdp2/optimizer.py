"""The engine over an FSDP2 (``fully_shard``) model: what ``gs.get_optimizer`` (graphstep/factory.py) builds when the
params are DTensors.

It is the plain engine laid out over each param's padded local shard (graphstep/fsdp2/shards.py) with no
data-parallel sharding of its own (FSDP2 reduce-scatters the grads in backward and all-gathers the params in
forward), the grad statistics summed over the device mesh, FSDP2's tensors bound to the flat buffers
(bindings.py), and torch's state-dict format for torch.distributed.checkpoint (state_dict.py). The shards, the
check of the families over them and the binding reach the build as its input (graphstep/assembly.py
``LocalShardInput``); the engine runs the bindings' checks before each step like its own.
"""

from __future__ import annotations

import dataclasses
import functools

from ..plan.model_params import as_chunks, named_trainable_params
from ..checkpoint.optimizer_hooks import runs_load_state_dict_hooks, runs_state_dict_hooks
from ..config import OptimizerConfig
from ..assembly import LocalShardInput
from ..engine import GraphstepOptimizer
from . import state_dict as fsdp_state_dict
from .bindings import FsdpBindings
from .shards import local_shards, statistics_group

# What FSDP2 does itself, or what needs whole heads a rank does not hold: refused with the reason (the config
# already refuses overlap_grad_reduce / overlap_param_gather without use_distributed_optimizer).
_REFUSED = {
    "use_distributed_optimizer": "FSDP2 shards the params and reduce-scatters the grads itself",
    "optimizer_cpu_offload": "CPU offload is not supported with FSDP2 models",
    "qk_clip": "QK-clip rescales whole attention heads, which FSDP2 splits across ranks",
}


def _check_config(config: OptimizerConfig) -> None:
    for field, why in _REFUSED.items():
        if getattr(config, field):
            raise ValueError(f"graphstep: {field}=True with an FSDP2 model: {why}")
    if config.params_dtype is not None:
        raise ValueError("graphstep: params_dtype with an FSDP2 model: the sharded params stay fp32; set the compute "
                         "dtype with fully_shard's mp_policy=MixedPrecisionPolicy(param_dtype=...)")


class Fsdp2Optimizer(GraphstepOptimizer):
    """``GraphstepOptimizer`` for a model whose trainable params are all ``fully_shard``-ed DTensors.

    ``bf16`` / ``fp16`` in the config name the compute dtype FSDP2's ``MixedPrecisionPolicy`` runs in: nothing is
    cast (the sharded params stay fp32, and so are their grads), and ``fp16`` scales the loss dynamically as
    usual. ``fold_grad_norm`` is off: no param hook of the engine's sees FSDP2's grads.
    """

    def __init__(self, config: OptimizerConfig, model_chunks, config_overrides=None):
        if not isinstance(config, OptimizerConfig):
            raise TypeError(f"get_optimizer: config must be an OptimizerConfig, got {type(config).__name__}")
        _check_config(config)
        shards = local_shards(named_trainable_params(model_chunks, dtensors=True), as_chunks(model_chunks))
        group = statistics_group(shards)
        one_dim_mesh = all(s.param.device_mesh.ndim == 1 for s in shards)
        if one_dim_mesh:
            # Each rank holds other rows of every param: Megatron's mark for a split param, with the mesh's group
            # as the tensor-parallel one, so that Muon gathers (or orthogonalises across) a matrix's rows.
            for shard in shards:
                shard.local.tensor_model_parallel, shard.local.partition_dim = True, 0
        laid_out = LocalShardInput(tuple(shards), functools.partial(_check_families, shards, config, one_dim_mesh),
                                   functools.partial(FsdpBindings, shards))
        super().__init__(dataclasses.replace(config, fold_grad_norm=False), model_chunks, config_overrides,
                         model_parallel_group=group, tensor_parallel_group=group if one_dim_mesh else None,
                         local_shards=laid_out)
        self._mesh_group = group

    @runs_state_dict_hooks
    def state_dict(self) -> dict:
        """torch's optimizer format, state as DTensors over the live buffers (graphstep/fsdp2/state_dict.py)."""
        return fsdp_state_dict.entries(self.checkpoint_view())

    @runs_load_state_dict_hooks
    def load_state_dict(self, state_dict: dict) -> None:
        """torch's optimizer format, int or FQN keys: checked whole, then copied into the buffers in place."""
        fsdp_state_dict.load(self.checkpoint_view(), state_dict, mesh_group=self._mesh_group,
                             group_problem=self._build.group_watch.unfollowable_edit)


def _check_families(shards: list, config: OptimizerConfig, one_dim_mesh: bool, families: list) -> None:
    """Refuses a family (``families``: each shard's) that cannot update these local shards."""
    for shard, family in zip(shards, families):
        if not family.batch_by_shape:
            continue
        if not one_dim_mesh:
            raise ValueError(f"graphstep: param '{shard.name}': {family.title} updates whole matrices, gathered "
                             "over one mesh dimension: not on a mesh of several dimensions")
        if family.updates_split_matrices_by_slice(config):
            raise ValueError(f"graphstep: param '{shard.name}': {family.title} with muon_tp_mode='blockwise' "
                             "would orthogonalise each rank's rows alone; with FSDP2 set muon_tp_mode="
                             "'duplicated' (each rank gathers the matrix) or 'distributed' (Newton-Schulz on "
                             "the rows, Gram matrices summed over the ranks)")
        rows, world = shard.fsdp_param._orig_size[0], shard.param.device_mesh.size()
        if rows % world:
            raise ValueError(f"graphstep: param '{shard.name}' has {rows} rows over {world} ranks: {family.title} "
                             "needs matrices FSDP2 splits evenly")
