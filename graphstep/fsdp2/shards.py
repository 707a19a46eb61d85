"""An FSDP2 model's params as graphstep lays them out: each DTensor param's local shard, padded as FSDP2 pads it.

graphstep lays out one plain ``nn.Parameter`` per param over FSDP2's padded local chunk (``LocalShard.local``,
docs/fsdp2-notes.md §1) and treats those as an ordinary model: FSDP2 reduce-scatters and all-gathers, and
``bindings.py`` points FSDP2's tensors at the flat buffers. So that the grad norm, the non-finite check and
``num_zeros`` count every element once across the mesh, a shard replicated along a mesh dimension where this
rank's coordinate is not 0 is marked ``shared`` (counted on no rank here); padding rows are never counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class LocalShard:
    name: str
    param: torch.Tensor  # the model's DTensor param (FSDP2's ``sharded_param``)
    fsdp_param: Any  # torch's ``FSDPParam`` for it
    local: torch.nn.Parameter  # a plain param over the padded local chunk: what graphstep lays out
    rows: int  # this rank's real rows of dim 0; the chunk's rows past them are FSDP2's padding

    def real_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (the padded chunk's elements, any shape) as the real rows, a view."""
        tensor = tensor.view(self.local.shape)
        return tensor.narrow(0, 0, self.rows) if tensor.dim() else tensor

    @property
    def real_shape(self) -> tuple[int, ...]:
        """The shape of the real rows: what FSDP2's local tensor (and each state of torch's format) has."""
        return tuple(self.real_rows(self.local.detach()).shape)

    @property
    def padding(self) -> int:
        """Elements of the padded chunk past the real rows (always zero)."""
        return self.local.numel() - math.prod(self.real_shape)


def _param_groups(state) -> list:
    """An ``FSDPState``'s param groups: a list in newer torch (``_fsdp_param_groups``), one group or None in
    torch 2.11 (``_fsdp_param_group``)."""
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    group = state._fsdp_param_group
    return [group] if group is not None else []


def _fsdp_params(chunks) -> dict[int, Any]:
    """``FSDPParam`` by id of its sharded param, over every ``fully_shard``-ed module of ``chunks``."""
    from torch.distributed.fsdp import FSDPModule
    found = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, FSDPModule):
                for group in _param_groups(module._get_fsdp_state()):
                    for fsdp_param in group.fsdp_params:
                        found[id(fsdp_param.sharded_param)] = fsdp_param
    return found


def local_shards(named, chunks) -> list[LocalShard]:
    """One ``LocalShard`` per (name, DTensor param) of ``named``, refusing params graphstep cannot lay out here."""
    from torch.distributed.tensor import DTensor
    fsdp_params = _fsdp_params(chunks)
    shards = []
    for name, p in named:
        fsdp_param = fsdp_params.get(id(p))
        if fsdp_param is None:
            kind = "a DTensor" if isinstance(p, DTensor) else "a plain tensor"
            raise ValueError(f"param '{name}' is {kind} that fully_shard does not manage: graphstep takes FSDP2 "
                             "models whose every trainable param is sharded by fully_shard (apply fully_shard to "
                             "the root module too)")
        if fsdp_param.fsdp_placement.dim != 0:
            raise ValueError(f"param '{name}' is sharded along dim {fsdp_param.fsdp_placement.dim}: graphstep takes "
                             "fully_shard's default Shard(0) placement")
        if fsdp_param.offload_to_cpu:
            raise ValueError(f"param '{name}': fully_shard's CPUOffloadPolicy is not supported with graphstep")
        if p.dtype != torch.float32:
            raise ValueError(f"param '{name}' is sharded in {p.dtype}: graphstep steps fp32 sharded params; keep the "
                             "model in fp32 and set fully_shard's mp_policy=MixedPrecisionPolicy(param_dtype="
                             "torch.bfloat16) for bf16 compute")
        data = fsdp_param._sharded_param_data
        local = torch.nn.Parameter(data.view(fsdp_param.padded_sharded_param_size), requires_grad=True)
        local.fsdp2_local_shard = True  # no config casts it (graphstep/plan/model_params.py)
        rows = fsdp_param.sharded_size[0] if len(fsdp_param.sharded_size) else 1
        if not _counted_here(p, name):
            local.shared = True  # another rank's copy counts (graphstep/plan/model_parallel.py)
        shard = LocalShard(name, p, fsdp_param, local, rows)
        local.fsdp2_padding = shard.padding  # left out of num_zeros (graphstep/plan/layout.py ParamSpec.zero_tail)
        shards.append(shard)
    return shards


def _counted_here(p, name: str) -> bool:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's dp placement over a TP split
    mesh = p.device_mesh
    coordinate = mesh.get_coordinate()
    for dim, placement in enumerate(p.placements):
        if not isinstance(placement, (Shard, _StridedShard, Replicate)):
            raise ValueError(f"param '{name}' has placement {placement} on mesh dim {dim}: graphstep takes Shard and "
                             "Replicate placements")
        if isinstance(placement, Replicate) and coordinate[dim] != 0:
            return False
    root = mesh._get_root_mesh()
    if root is not mesh:
        own = set(mesh.mesh_dim_names or ())
        for dim_name in root.mesh_dim_names or ():
            if dim_name not in own and root.get_local_rank(dim_name) != 0:
                return False
    return True


def statistics_group(shards: list[LocalShard]):
    """The group the grad statistics are summed over: the ranks of the params' root mesh (one for all)."""
    roots = list({id(root): root for root in (s.param.device_mesh._get_root_mesh() for s in shards)}.values())
    meshes = {tuple(root.mesh.flatten().tolist()) for root in roots}
    if len(meshes) != 1:
        raise ValueError(f"graphstep: the FSDP2 model's params lie on {len(meshes)} different device meshes; "
                         "graphstep takes a model sharded over one mesh")
    root = roots[0]
    ranks = sorted(root.mesh.flatten().tolist())
    if len(ranks) == 1:
        return None
    if root.ndim == 1:
        return root.get_group()
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return root._flatten().get_group()
