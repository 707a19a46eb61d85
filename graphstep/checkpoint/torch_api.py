"""graphstep's own counterparts of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` /
``set_optimizer_state_dict``, in graphstep's reshardable format (``sharded.py``), and ``ParamState``, the
engine's ``Optimizer.state`` mapping.

torch's own functions work on a graphstep optimizer too, in torch's optimizer format (``torch_format.py``:
``opt.state_dict()`` gives it to them, ``opt.load_state_dict()`` takes it); these stay for code written
against graphstep's format (``gs.checkpoint.save`` / ``load`` use it). ``placed_model_state_dict`` does for the
model's state dict of a tensor-parallel model what the optimizer's entries do by themselves: it puts each slice at
its place in the whole param, so that DCP saves the slices side by side instead of one over the other.
"""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any

import torch

from . import sharded
from .param_pieces import RankGrid, group_ranks, sharded_param
from .torch_entries import param_entries


def _single(optimizers):
    # A graphstep optimizer is known by its checkpoint view: this module sits below the engine and does not
    # import it.
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if len(opts) != 1 or not callable(getattr(opts[0], "checkpoint_view", None)):
        raise TypeError("graphstep.checkpoint.get/set_optimizer_state_dict take one graphstep optimizer (from "
                        "gs.get_optimizer); for torch.optim optimizers use torch.distributed.checkpoint's own")
    return opts[0]


def _check_options(options: Any) -> None:
    if options is not None and (getattr(options, "full_state_dict", False) or getattr(options, "cpu_offload",
                                                                                         False)):
        raise ValueError("graphstep's optimizer state dict is always sharded (each rank its own ranges, "
                         "resharded by DCP at load): full_state_dict/cpu_offload are not supported")


def get_optimizer_state_dict(model, optimizers, *, submodules=None, options=None) -> dict:
    """``sharded_state_dict(opt)`` (``model`` is accepted for torch's call shape; the names come from the
    optimizer, which recorded them at ``get_optimizer``)."""
    _check_options(options)
    return sharded.entries(_single(optimizers).checkpoint_view())


def set_optimizer_state_dict(model, optimizers, optim_state_dict: dict, *, options=None) -> None:
    """``load_sharded_state_dict(opt, optim_state_dict)``: validated, copied in place, params published."""
    _check_options(options)
    sharded.load(_single(optimizers).checkpoint_view(), optim_state_dict)


def placed_model_state_dict(opt, model_state_dict: dict) -> dict:
    """``model_state_dict`` (from torch's ``get_state_dict`` / ``get_model_state_dict``) with each tensor-parallel
    slice of a param ``opt`` holds replaced by a ShardedTensor of the whole param whose one local piece is that
    same tensor (no copy). torch's functions key a model's state by param name, so the tensor-parallel ranks'
    slices of one param (Megatron-Core's ``tensor_model_parallel`` / ``partition_dim`` marks on plain tensors)
    would meet under one name in a DCP checkpoint and only one would be kept; placed, each slice is saved once,
    and ``dcp.load`` fills each rank's slice in place from a checkpoint of any tensor-parallel size. Pass the
    result to ``dcp.save`` / ``dcp.load`` and the original dict to ``set_state_dict``. Other entries are kept
    as they are (the same dict without tensor parallelism). Collective over the optimizer's ranks, like
    ``get_state_dict`` on it."""
    entries = param_entries(opt.checkpoint_view().domains, "placed_model_state_dict", with_grid=False)
    split = {}
    for entry in entries.values():
        if entry.where.split:
            p = entry.domain.buffers.params[entry.place.index]
            split[(p.data_ptr(), tuple(p.shape), p.dtype)] = entry
    placed = dict(model_state_dict)
    for key, value in model_state_dict.items():
        entry = split.get((value.data_ptr(), tuple(value.shape), value.dtype)) if isinstance(value, torch.Tensor) \
            else None
        if entry is None:
            continue
        if not value.is_contiguous():
            raise ValueError(f"placed_model_state_dict: [{key!r}] is not contiguous: pass the dict torch's "
                             "get_state_dict returned, whose values are the params' own tensors")
        grid = RankGrid(tuple((rank,) for rank in group_ranks(entry.domain.comm.tp_group, 1)))
        whole = SimpleNamespace(param_start=0, param_end=value.numel())
        placed[key] = sharded_param(value.view(-1), entry.where, value.dtype, [(0, whole)], grid, 0, value.device)
    return placed


class ParamState(collections.defaultdict):
    """The engine's ``Optimizer.state``: torch's per-param mapping, each entry naming the one step count the params
    share (the state itself lives in flat buffers: ``opt.state_dict()``, torch's ``get_state_dict``). Never empty
    after the build, so torch's ``get_state_dict`` / ``set_state_dict`` never run their zero-lr initialising
    step on it; entries cannot be removed."""

    def _refuse_reset(self, *args, **kwargs):
        raise TypeError(STATE_RESET)

    # torch's optimizers start a param's state over when its entry goes; graphstep's lives in flat buffers.
    __delitem__ = clear = pop = popitem = _refuse_reset


STATE_RESET = ("graphstep keeps the optimizer state in flat buffers, not in opt.state (which holds each param's "
                "step count only): removing or replacing its entries would reset nothing. To start the state over, "
                "build a new optimizer; to restore one, load a state dict")
