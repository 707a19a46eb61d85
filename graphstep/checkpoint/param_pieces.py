"""Where each rank's piece of a param lies in the whole param its checkpoint key names, as a ``ShardedTensor``
that torch.distributed.checkpoint saves and reshards like any sharded tensor.

Two splits compose: tensor parallelism gives each rank a slice of the whole param along ``partition_dim``
(the key names the whole param, as Megatron-Core and DTensor's ``Shard(dim)`` do), and the distributed
optimizer gives each data-parallel rank a contiguous range of its slice, which ignores param boundaries.
Such a range of a row-major tensor is at most ``2 * ndim - 1`` boxes, each a view of the rank's slice;
DTensor cannot say this (its ``Shard(dim)`` is torch.chunk's even split). Computed locally, no collective.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes), one per dim


def boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes covering flat elements ``[start, end)`` of a row-major tensor of ``shape``, in flat order."""
    shape = tuple(shape)
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first_row, first_off = divmod(start, inner)
    last_row, last_off = divmod(end, inner)
    if first_row == last_row:
        return [((first_row, *o), (1, *s)) for o, s in boxes(shape[1:], first_off, last_off)]
    out = []
    if first_off:
        out += [((first_row, *o), (1, *s)) for o, s in boxes(shape[1:], first_off, inner)]
        first_row += 1
    if last_row > first_row:
        out.append(((first_row,) + (0,) * (len(shape) - 1), (last_row - first_row, *shape[1:])))
    if last_off:
        out += [((last_row, *o), (1, *s)) for o, s in boxes(shape[1:], 0, last_off)]
    return out


@dataclass(frozen=True)
class SliceOfWhole:
    """A rank's param in the tensor its key names: the whole of it (``parts`` 1), or slice ``part`` of ``parts``
    equal slices along ``dim`` (a tensor-parallel split)."""

    shape: tuple[int, ...]  # the rank's param's
    dim: int = 0
    parts: int = 1
    part: int = 0

    @property
    def split(self) -> bool:
        return self.parts > 1

    @property
    def global_shape(self) -> tuple[int, ...]:
        if not self.split:
            return self.shape
        return tuple(size * self.parts if d == self.dim else size for d, size in enumerate(self.shape))

    def offsets(self, part: Optional[int] = None) -> tuple[int, ...]:
        """Where slice ``part`` (default: this rank's) starts in the whole tensor."""
        part = self.part if part is None else part
        return tuple(part * size if self.split and d == self.dim else 0 for d, size in enumerate(self.shape))

    def boxes(self, start: int, end: int, part: Optional[int] = None) -> list[Box]:
        """The boxes, in the whole tensor, of flat elements ``[start, end)`` of slice ``part``."""
        shift = self.offsets(part)
        return [(tuple(o + s for o, s in zip(offsets, shift)), sizes)
                for offsets, sizes in boxes(self.shape, start, end)]

    def local_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a tensor of ``global_shape``."""
        if not self.split:
            return whole
        return whole.narrow(self.dim, self.offsets()[self.dim], self.shape[self.dim])


def slice_of_whole(p: torch.Tensor, name: str, tp_size: int, tp_rank: int) -> SliceOfWhole:
    """Where ``p`` lies: split over a tensor-parallel group of ``tp_size`` ranks when Megatron-Core marks it so
    (``tensor_model_parallel`` with its ``partition_dim``), else whole."""
    if tp_size <= 1 or not getattr(p, "tensor_model_parallel", False):
        return SliceOfWhole(tuple(p.shape))
    dim = getattr(p, "partition_dim", None)
    if dim is None:
        raise NotImplementedError(
            f"torch's get_state_dict / set_state_dict: param '{name}' is marked tensor_model_parallel without a "
            "partition_dim, so where its slice lies in the whole param is unknown: set p.partition_dim (the "
            "dimension it is split along, as Megatron-Core's layers do), or save each rank's opt.state_dict() "
            "with torch.save")
    return SliceOfWhole(tuple(p.shape), dim % p.dim(), tp_size, tp_rank)


def ownership(layout) -> dict[int, list]:
    """param index -> [(data-parallel rank, OwnedRange)], for every rank: the layout is the same everywhere."""
    owners: dict[int, list] = {i: [] for i in range(len(layout.params))}
    for rank in range(layout.dp_size):
        for owned in layout.owned_ranges(rank):
            owners[owned.param].append((rank, owned))
    return owners


def group_ranks(group, size: int) -> list[int]:
    """The global ranks of ``group`` in its order; this process alone without one."""
    if group is not None:
        return dist.get_process_group_ranks(group)
    if size == 1 and dist.is_available() and dist.is_initialized():
        return [dist.get_rank()]
    return list(range(size))


@dataclass(frozen=True)
class RankGrid:
    """The global rank of each (tensor-parallel part, data-parallel rank) of one domain, and this rank's part:
    the data-parallel ranks of a param the tensor-parallel ranks hold whole (replicated) are its own part's."""

    ranks: tuple[tuple[int, ...], ...]  # [part][data-parallel rank]
    part: int = 0

    @classmethod
    def of(cls, dp_ranks: list[int], tp_group) -> "RankGrid":
        """Every tensor-parallel rank's data-parallel ranks: one all-gather over ``tp_group`` (None: no split)."""
        if tp_group is None or dist.get_world_size(tp_group) == 1:
            return cls((tuple(dp_ranks),))
        gathered: list = [None] * dist.get_world_size(tp_group)
        dist.all_gather_object(gathered, list(dp_ranks), group=tp_group)
        return cls(tuple(tuple(ranks) for ranks in gathered), dist.get_rank(tp_group))

    def holders(self, where: "SliceOfWhole", part: int) -> tuple[int, ...]:
        """The global ranks, by data-parallel rank, of slice ``part`` of a param placed ``where``."""
        return self.ranks[part if where.split else self.part]


def sharded_param(local: Optional[torch.Tensor], where: SliceOfWhole, dtype: torch.dtype, owners: list,
                  grid: RankGrid, rank: int, device) -> "torch.Tensor":
    """A ShardedTensor of ``where.global_shape``: each (tensor-parallel part, data-parallel owner)'s range as its
    boxes, this rank's (part ``where.part``, data-parallel rank ``rank``) backed by ``local`` (its flattened range,
    contiguous; None where it owns none)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    shards_md, local_shards = [], []
    for part in range(where.parts):
        for owner, owned in owners:
            mine = part == where.part and owner == rank
            placed_on = local.device if mine and local is not None else device
            position = 0
            for offsets, sizes in where.boxes(owned.param_start, owned.param_end, part):
                md = ShardMetadata(list(offsets), list(sizes), f"rank:{grid.holders(where, part)[owner]}/{placed_on}")
                shards_md.append(md)
                numel = math.prod(sizes)
                if mine:
                    local_shards.append(Shard(local[position:position + numel].view(sizes), md))
                position += numel
    if not local_shards and where.shape:
        # This rank holds none of it: an empty piece, for DCP drops a ShardedTensor without local shards from what
        # a rank loads, and a checkpoint key missing there makes dcp.load take it for one of torch 2.3's. At the
        # far corner, where no piece with elements starts: DCP keeps one of two pieces at one offset.
        md = ShardMetadata(list(where.global_shape), [0] * len(where.shape),
                           f"rank:{grid.holders(where, where.part)[rank]}/{device}")
        shards_md.append(md)
        local_shards.append(Shard(torch.empty([0] * len(where.shape), dtype=dtype, device=device), md))
    metadata = ShardedTensorMetadata(shards_md, torch.Size(where.global_shape),
                                     TensorProperties(dtype=dtype, layout=torch.strided))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor's deprecation notice (see graphstep/checkpoint/sharded.py)
        return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata)


def local_boxes(value) -> list[tuple[Box, torch.Tensor]]:
    """A ShardedTensor's local shards as ((offsets, sizes), tensor), in its order, empty ones left out."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shards = value.local_shards()
    return [((tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)), s.tensor) for s in shards
            if math.prod(s.metadata.shard_sizes) > 0]  # an empty piece: a rank holding none of it (sharded_param)


def global_shape(value) -> tuple[int, ...]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tuple(value.size())
