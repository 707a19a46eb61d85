"""Where each data-parallel rank's piece of a param lies, and that piece as a ``ShardedTensor`` of the param's
own shape, which torch.distributed.checkpoint (DCP) saves and reshards like any sharded tensor.

A rank owns a contiguous range of a param's flattened elements (``layout.owned_ranges``: the bucket shards
ignore param boundaries, so a rank may own a sliver of a param, all of it, or none). A ShardedTensor's shards
are boxes (an offset and a size per dim), and a contiguous range of a row-major tensor is at most
``2 * ndim - 1`` boxes: the rest of the first partial row, whole rows, the start of the last partial row,
recursively per dim. Each box is contiguous in the flat range, so its tensor is a view of the rank's slice.
DTensor cannot say this: its ``Shard(dim)`` placement is torch.chunk's even split.

The metadata is computed on every rank from the layout (the same everywhere): no collective.
"""

from __future__ import annotations

import math
import warnings
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


def ownership(layout) -> dict[int, list]:
    """param index -> [(data-parallel rank, OwnedRange)], for every rank: the layout is the same everywhere."""
    owners: dict[int, list] = {i: [] for i in range(len(layout.params))}
    for rank in range(layout.dp_size):
        for owned in layout.owned_ranges(rank):
            owners[owned.param].append((rank, owned))
    return owners


def dp_global_ranks(opt) -> list[int]:
    """The global rank of each data-parallel rank (ShardedTensor placements name global ranks)."""
    group = getattr(getattr(opt, "comm", None), "dp_group", None)
    return dist.get_process_group_ranks(group) if group is not None else list(range(opt.layout.dp_size))


def sharded_param(local: Optional[torch.Tensor], shape: Sequence[int], dtype: torch.dtype, owners: list,
                  global_ranks: list[int], rank: int, device) -> "torch.Tensor":
    """A ShardedTensor of global ``shape``: each owner's range as its boxes, this rank's backed by ``local``
    (its flattened range, contiguous; None where it owns none)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    shards_md, local_shards = [], []
    for owner, owned in owners:
        where = local.device if owner == rank and local is not None else device
        position = 0
        for offsets, sizes in boxes(shape, owned.param_start, owned.param_end):
            md = ShardMetadata(list(offsets), list(sizes), f"rank:{global_ranks[owner]}/{where}")
            shards_md.append(md)
            numel = math.prod(sizes)
            if owner == rank:
                local_shards.append(Shard(local[position:position + numel].view(sizes), md))
            position += numel
    metadata = ShardedTensorMetadata(shards_md, torch.Size(shape), TensorProperties(dtype=dtype, layout=torch.strided))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor's deprecation notice (see graphstep/checkpoint/sharded.py)
        return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata)


def local_boxes(value) -> list[tuple[Box, torch.Tensor]]:
    """A ShardedTensor's local shards as ((offsets, sizes), tensor), in its order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shards = value.local_shards()
    return [((tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)), s.tensor) for s in shards]


def global_shape(value) -> tuple[int, ...]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tuple(value.size())
