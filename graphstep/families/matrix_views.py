"""Whole-matrix views for Muon: a group's params as (n, rows, cols) batches, one per run of equal shapes.

Newton–Schulz orthogonalises whole matrices, so Muon cannot run over the flat segments the elementwise families
use. The layout places a Muon group's same-shape matrices at evenly spaced offsets, so one ``as_strided`` view
covers a run of them in every buffer without a copy, and the step's op count follows the number of distinct
shapes, not of matrices. The layout's order matters for speed only: a run breaks wherever shape, buffer, QKV
split or spacing changes. A fused QKV weight with ``MuonOptions.split_qkv`` is split by its ``qkv_split``; one
named like Megatron's ``linear_qkv.weight`` without one is refused, since its head layout cannot be read off
the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch

from ..kernels.muon import QKVSplit, TensorParallelSplit

MEGATRON_QKV_SUFFIX = "linear_qkv.weight"


@dataclass(frozen=True)
class MatrixViews:
    """One Muon group: parallel lists of (n, r, c) views, one entry per run of same-shape matrices."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    state: Mapping[str, list[torch.Tensor]]
    qkv_splits: list[Optional[QKVSplit]] = field(default_factory=list)
    tp_splits: list[Optional[TensorParallelSplit]] = field(default_factory=list)


def check_whole_matrices(ctx, group: int) -> None:
    """Refuse a group Muon cannot run, on every rank alike: a param that is not 2-D, a fused QKV weight
    without its split, or a matrix this rank owns only part of (Muon needs whole matrices on one rank).

    The layout guarantees it (with several ranks Muon's params are sharded layer-wise, graphstep.plan.layerwise);
    this guards a layout built otherwise, whose element shards would cut matrices.
    """
    layout = ctx.layout
    for place in layout.params:  # every matrix, this rank's or not, so that all ranks refuse alike
        if place.group != group:
            continue
        if len(place.shape) != 2:
            raise ValueError(f"param '{place.name}' of shape {place.shape} is in a Muon group: Muon orthogonalises "
                             "2-D matrices only; route it to the scalar optimizer (muon_scalar_optimizer)")
        qkv_split_of(ctx.buffers.params[place.index], place.name, place.shape, ctx.config)
    for owned in layout.owned_ranges(ctx.rank):
        place = layout.params[owned.param]
        if place.group == group and (owned.param_start, owned.param_end) != (0, place.numel):
            raise ValueError(f"optimizer family 'muon' (param group {group}): rank {ctx.rank} owns elements "
                             f"[{owned.param_start}, {owned.param_end}) of '{place.name}' ({place.numel} "
                             "elements), but Newton–Schulz needs whole matrices: plan the layout with "
                             "batch_by_shape=True for Muon params, so they are sharded layer-wise")


def qkv_split_of(param: torch.Tensor, name: str, shape: tuple, config) -> Optional[QKVSplit]:
    """The split a fused QKV weight is orthogonalised with, or None (see the module docstring)."""
    if not config.muon.split_qkv:
        return None
    split = getattr(param, "qkv_split", None)
    if split is None:
        if name.endswith(MEGATRON_QKV_SUFFIX):
            raise ValueError(f"param '{name}' looks like Megatron's fused QKV weight and muon_split_qkv=True, but "
                             "its head layout is unknown: set param.qkv_split = graphstep.QKVSplit(num_groups, "
                             "q_rows, k_rows, v_rows) (or register its attention with graphstep.qk_clip."
                             "register(..., qkv=...)), or set muon_split_qkv=False")
        return None
    if not isinstance(split, QKVSplit):
        raise TypeError(f"param '{name}'.qkv_split is a {type(split).__name__}, expected a graphstep.QKVSplit")
    split.check(shape[0])
    return split


def tensor_parallel_dim(param: torch.Tensor, name: str, comm) -> Optional[int]:
    """The dimension (0 or 1) ``param`` is split along over the tensor-parallel group, or None: not marked
    ``tensor_model_parallel``, or no such group (the param is then the whole matrix)."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    if name in comm.experts_split_elsewhere:
        raise ValueError(f"param '{name}' is an expert param split over expert_tensor_parallel_group, which differs "
                         "from tensor_parallel_group, and it shares the dense layout (one data-parallel rank): Muon "
                         "would gather its slices over the wrong group. Pass expert_data_parallel_group (a group of "
                         "this rank alone) with use_distributed_optimizer=True to give the experts a domain of their "
                         "own")
    if comm.tp_group is None:
        return None
    dim = getattr(param, "partition_dim", None)  # a dimension of the param when set (checked at build)
    if dim is None:
        raise ValueError(f"param '{name}' is marked tensor_model_parallel without a partition_dim: Muon needs to "
                         "know along which of its dimensions it is split")
    if getattr(param, "partition_stride", 1) != 1:
        raise ValueError(f"param '{name}' has partition_stride={param.partition_stride}: Muon on strided tensor-"
                         "parallel splits is not supported (gather its slices in Megatron's order first)")
    return dim % 2


def _tp_split(comm, dim: Optional[int]) -> Optional[TensorParallelSplit]:
    if dim is None:
        return None
    return TensorParallelSplit(dim, comm.tp_size, comm.tp_rank,
                               lambda out, inp: comm.tp_all_gather(out, inp, "Muon tensor-parallel all_gather"),
                               lambda t: comm.tp_all_reduce_sum(t, "Muon tensor-parallel all_reduce"))


def matrix_views(ctx, group: int, segments: Sequence, sources) -> MatrixViews:
    """The (n, r, c) views of group ``group``'s params in ``sources`` (a families.ViewSources)."""
    layout, config = ctx.layout, ctx.config
    owned = {r.param: r for r in layout.owned_ranges(ctx.rank)}  # whole matrices: check_whole_matrices ran
    places = sorted((p for p in layout.params if p.group == group and p.index in owned),
                    key=lambda p: (p.buffer, p.start))
    # [buffer, shape, split, first shard offset, spacing, count, first flat offset, first state offsets].
    # Sources in flat coordinates (fp32 params that are their own main params; grads reduced in place:
    # families.ViewSources) are cut at the flat offset, and state at its offset in the compact state
    # buffer (graphstep/state/state_ranges.py), so a run also needs the same spacing there (true inside one
    # bucket's segment).
    names = tuple(sources.state)
    runs: list[list] = []
    for place in places:
        mine = owned[place.index]
        param = ctx.buffers.params[place.index]
        split = qkv_split_of(param, place.name, place.shape, config)
        tp_dim = tensor_parallel_dim(param, place.name, ctx.comm)
        states = tuple(sources.state_at(n, place.buffer, mine.shard_start, place.numel) for n in names)
        run = runs[-1] if runs else None
        if (run is not None and run[:3] == [place.buffer, place.shape, split] and run[8] == tp_dim
                and mine.shard_start - run[3] == mine.flat_start - run[6]
                and all(o - r == mine.shard_start - run[3] for o, r in zip(states, run[7]))
                and (run[5] == 1 or mine.shard_start - run[3] == run[4] * run[5])):
            if run[5] == 1:
                run[4] = mine.shard_start - run[3]
            run[5] += 1
        else:
            runs.append([place.buffer, place.shape, split, mine.shard_start, 0, 1, mine.flat_start, states, tp_dim])

    def cut(tensors, in_flat=(), state=None):
        views = []
        for buffer, (rows, cols), _, start, spacing, count, flat_start, states, _ in runs:
            base = tensors[buffer]
            offset = states[state] if state is not None else flat_start if in_flat and in_flat[buffer] else start
            views.append(base.as_strided((count, rows, cols), (spacing or rows * cols, cols, 1),
                                         base.storage_offset() + offset))
        return views

    return MatrixViews(cut(sources.main, sources.main_in_flat), cut(sources.grads, sources.grads_in_flat),
                       {name: cut(sources.state[name], state=i) for i, name in enumerate(names)},
                       [run[2] for run in runs], [_tp_split(ctx.comm, run[8]) for run in runs])
