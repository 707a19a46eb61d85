"""torch's optimizer format for a graphstep optimizer, so that torch.distributed.checkpoint.state_dict's
``get_state_dict`` / ``set_state_dict`` (and ``get_/set_optimizer_state_dict``) save, load and reshard it
through DCP like a ``torch.optim`` optimizer's, for every model graphstep takes but FSDP2's (whose optimizer
has its own: graphstep/fsdp2/state_dict.py).

The format is ``torch.optim.Optimizer.state_dict()``'s: ``{"state": {index: {...}}, "param_groups": [{...,
"params": [index, ...]}]}``, indices numbering the params in ``param_groups`` order (torch's functions turn
them into FQNs). Per param:

- ``"step"``: the step count (0-d, a copy of graphstep's one shared count);
- each state its family keeps (``exp_avg`` / ``exp_avg_sq``, ``momentum_buffer``, ...), shaped like the param,
  in the dtype a checkpoint holds (fp32 for a state kept below it);
- ``"fp32_param"``: the main params, where they are not the model params themselves (bf16/fp16/fp8 params,
  CPU offload), so that a resume is exact.

With one data-parallel rank (a plain model, DDP) each is a plain tensor of all the param's elements. With the
distributed optimizer a rank holds only its range of each param: the entry is a ``ShardedTensor`` of the
param's shape holding that range as boxes (``param_pieces.py``), which DCP saves per owner and reshards at
load to any data-parallel size, layout or model wrapper, a plain one included. Step-wide values torch has
no place for ride in every group under ``"graphstep"`` (as the FSDP2 path does): ``clip_grad``,
``grad_norm_skip_threshold``, ``loss_scaler`` and, in the first group, the fp8 weights' state.

The entries are copies: DCP loads into them, and ``set_state_dict`` validates all of it (shapes, dtypes,
finiteness, one step count, the groups' hyperparameters, the scaler) on every rank before anything is
copied into the static buffers, in place, so a captured step stays valid.

torch's functions call ``opt.state_dict()``, which must keep giving graphstep's flat format to everyone else
(``torch.save`` flows): ``torch_api_caller`` tells the two apart by the caller's module, the nearest frame
outside graphstep. A dict in this format is recognised by its keys, from any caller.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any, Optional

import torch

from ..families import families_of, state_spec
from ..fp8 import checkpoint as fp8_checkpoint
from .checks import (StateDictError, apply_common, check_mapping, check_param_groups, check_scaler, check_step,
                     check_tensor, check_thresholds, refuse_together)
from .param_pieces import boxes, dp_global_ranks, global_shape, local_boxes, ownership, sharded_param

TORCH_API = "torch.distributed.checkpoint.state_dict"
EXTRA = "graphstep"
MAIN_PARAM = "fp32_param"
_EXTRA_KEYS = ("clip_grad", "grad_norm_skip_threshold", "loss_scaler", "fp8")
_GROUP_BOOKKEEPING = ("params", "param_names", EXTRA)
_WHAT = "torch's get_state_dict / set_state_dict"


def torch_api_caller() -> Optional[FrameType]:
    """The frame of torch.distributed.checkpoint.state_dict that called ``opt.state_dict()``, or None for any
    other caller: the nearest frame outside graphstep (the engine's method and its hook wrapper sit between)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("graphstep."):
        frame = frame.f_back
    return frame if frame is not None and frame.f_globals.get("__name__") == TORCH_API else None


def _wants_full(caller: FrameType) -> bool:
    """torch asked for full tensors: ``full_state_dict`` in its options, or its full load path (which reads the
    optimizer's local state dict to distribute the full one into)."""
    frame = caller
    while frame is not None and frame.f_globals.get("__name__") == TORCH_API:
        if getattr(frame.f_locals.get("info"), "full_state_dict", False) or \
                frame.f_code.co_name == "_load_optim_state_dict":
            return True
        frame = frame.f_back
    return False


def is_torch_format(value: Any) -> bool:
    return isinstance(value, Mapping) and set(value) == {"state", "param_groups"}


def refuse_unsupported(opt, what: str) -> None:
    """The models whose params' names do not say which elements they are: refused, with what works."""
    if len(opt.domains) > 1:
        raise NotImplementedError(
            f"{what}: torch's checkpoint API does not cover expert params (expert_data_parallel_group) here: their "
            "names are local to each expert-parallel rank, so two experts would meet under one key of a DCP "
            "checkpoint (gs.checkpoint.save / load refuse them for the same reason). Save each rank's "
            "opt.state_dict() with torch.save and load it with opt.load_state_dict() (exact, same layout)")
    mp_group = opt.comm.mp_group
    if mp_group is not None and torch.distributed.get_world_size(mp_group) > 1:
        raise NotImplementedError(
            f"{what}: with a model_parallel_group of several ranks the tensor-parallel slices and pipeline stages "
            "of one param share its name, so their entries would overwrite each other in one DCP checkpoint "
            "(gs.checkpoint refuses them too). Save each rank's opt.state_dict() with torch.save and load it with "
            "opt.load_state_dict()")


def _kinds(opt, place, families) -> tuple[str, ...]:
    """The entries of param ``place`` besides its step: its main params where they are not the model param
    (``fp32_param``), then the states its group's family keeps."""
    buffers = opt.buffers
    separate = not buffers.main_is_param[place.buffer] or buffers.host is not None
    return ((MAIN_PARAM,) if separate else ()) + tuple(families[place.group].state_names(opt.config))


def _buffer_kind(kind: str) -> str:
    return "main" if kind == MAIN_PARAM else kind


def _saved_dtype(opt, kind: str, buffer: int) -> torch.dtype:
    return opt.buffers.shard_like(_buffer_kind(kind), buffer).dtype


def _copy_of(opt, kind: str, buffer: int, start: int, size: int) -> torch.Tensor:
    part = opt.buffers.read_part(_buffer_kind(kind), buffer, start, size)
    return part if opt.buffers.stored_kind(_buffer_kind(kind), buffer) is not None else part.clone()


def _extras(opt, first: bool) -> dict:
    return {"clip_grad": opt.clip_grad, "grad_norm_skip_threshold": opt.grad_norm_skip_threshold,
            "loss_scaler": None if opt.scaler is None else {k: v.clone() for k, v in opt.scaler.state_dict().items()},
            # None, not {}: an empty dict does not survive torch's full_state_dict gather or a DCP round trip.
            "fp8": (fp8_checkpoint.sharded_entries(opt, snapshot=True) or None) if first else None}


# ---- get ------------------------------------------------------------------------------------------------
def state_dict(opt, caller: FrameType) -> dict:
    """torch's optimizer format (see the module docstring), for torch's functions."""
    refuse_unsupported(opt, "get_state_dict")
    layout = opt.layout
    if layout.dp_size > 1 and _wants_full(caller):
        raise NotImplementedError(
            "torch's get_state_dict / set_state_dict with StateDictOptions(full_state_dict=True): with the "
            "distributed optimizer each rank holds only its range of each param's state, and torch's gather of "
            "sharded entries assumes an even split. Use the default options (sharded entries, which DCP saves "
            "and reshards to any data-parallel size), or gs.checkpoint.save / load")
    opt.finish_param_gather()
    families = families_of(opt.param_groups, opt.config.optimizer)
    index = {id(p): i for i, p in enumerate(opt.buffers.params)}
    mine = {o.param: o for o in layout.owned_ranges(opt.rank)}
    owners = ownership(layout) if layout.dp_size > 1 else None
    global_ranks = dp_global_ranks(opt) if owners is not None else None
    state, groups = {}, []
    for g, group in enumerate(opt.param_groups):
        saved = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
        saved["params"] = list(range(len(state), len(state) + len(group["params"])))
        saved[EXTRA] = _extras(opt, first=g == 0)
        groups.append(saved)
        for p in group["params"]:
            place = layout.params[index[id(p)]]
            state[len(state)] = _param_entry(opt, place, families, mine.get(place.index), owners, global_ranks)
    return {"state": state, "param_groups": groups}


def _param_entry(opt, place, families, mine, owners, global_ranks) -> dict:
    """One param's entry: plain tensors with one data-parallel rank, else ShardedTensors (``mine``: this rank's
    OwnedRange of the param, or None)."""
    entry = {"step": opt.tensors.step.clone()}
    for kind in _kinds(opt, place, families):
        local = None
        if mine is not None:
            local = _copy_of(opt, kind, place.buffer, mine.shard_start, mine.param_end - mine.param_start)
        if owners is None:
            entry[kind] = local.view(place.shape)
        else:
            entry[kind] = sharded_param(local, place.shape, _saved_dtype(opt, kind, place.buffer),
                                        owners[place.index], global_ranks, opt.rank, opt.device)
    return entry


# ---- set ------------------------------------------------------------------------------------------------
def _fail(where: str, problem: str) -> StateDictError:
    return StateDictError(f"{_WHAT} (load_state_dict in torch's format): {where} {problem}")


@torch.no_grad()
def load_state_dict(opt, sd: Mapping) -> None:
    """Validate ``sd`` whole on every data-parallel rank (refusing together), then copy in place and publish
    the params (collective with several ranks). A refused load names the key; nothing changed anywhere."""
    refuse_unsupported(opt, "set_state_dict")
    plan = refuse_together(opt, lambda: validate(opt, sd), "load_state_dict")
    for write in plan["copies"]:
        write()
    apply_common(opt, plan["step"], plan["groups"], plan["scaler"], plan["clip_grad"],
                 plan["grad_norm_skip_threshold"])
    opt.publish_params()
    fp8_checkpoint.apply(plan["fp8_copies"])  # the saved fp8 bytes and scales replace the publish's recast


def validate(opt, sd: Mapping) -> dict:
    """Every check of a load in torch's format, nothing copied; returns what ``load_state_dict`` copies."""
    saved_groups, state = sd["param_groups"], sd["state"]
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(opt.param_groups):
        raise _fail("['param_groups']", f"must be a list of {len(opt.param_groups)} groups, one per param group "
                                        "of this optimizer")
    if not isinstance(state, Mapping):
        raise _fail("['state']", f"must be a dict, got {type(state).__name__}")
    families = families_of(opt.param_groups, opt.config.optimizer)
    index = {id(p): i for i, p in enumerate(opt.buffers.params)}
    owned = {o.param: o for o in opt.layout.owned_ranges(opt.rank)}
    copies, steps = [], []
    for g, (saved, group) in enumerate(zip(saved_groups, opt.param_groups)):
        keys = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(keys, (list, tuple)) or len(keys) != len(group["params"]):
            raise _fail(f"['param_groups'][{g}]['params']", f"must list the group's {len(group['params'])} params "
                                                             "(saved from another model or other overrides?)")
        for key, p in zip(keys, group["params"]):  # paired by position, as torch.optim pairs them
            place = opt.layout.params[index[id(p)]]
            where = f"['state'][{key!r}]"
            if key not in state:
                raise _fail(where, f"is missing (the state of param '{place.name}')")
            kinds = _kinds(opt, place, families)
            if kinds and isinstance(state[key], Mapping) and set(state[key]) == {"step"}:
                raise _fail(where, f"holds only 'step', not {list(kinds)}. torch's set_state_dict / "
                                   "set_optimizer_state_dict with StateDictOptions(flatten_optimizer_state_dict=True) "
                                   "rebuild only the states opt.state lists, and graphstep's lists the step count "
                                   "only: save and load without that option")
            entry = check_mapping(state[key], where, ("step", *kinds), allowed=("step", *kinds))
            steps.append((where, entry["step"]))
            mine = owned.get(place.index)
            for kind in kinds:
                nonnegative = kind != MAIN_PARAM and state_spec(kind).nonnegative
                source = _local_part(entry[kind], f"{where}[{kind!r}]", place, mine,
                                     _saved_dtype(opt, kind, place.buffer), nonnegative)
                if source is not None:
                    copies.append(functools.partial(opt.buffers.write_part, _buffer_kind(kind), place.buffer,
                                                    mine.shard_start, source.numel(), source))
    step = _one_step(opt, steps)
    extra = _extra(opt, saved_groups)
    groups = [_hyperparameters(saved, group) for saved, group in zip(saved_groups, opt.param_groups)]
    updates = check_param_groups(opt, groups, "['param_groups']", check_indices=False)
    check_scaler(opt, extra["loss_scaler"], f"['param_groups'][0][{EXTRA!r}]['loss_scaler']")
    check_thresholds(extra["clip_grad"], extra["grad_norm_skip_threshold"], f"['param_groups'][0][{EXTRA!r}]")
    try:
        fp8_copies = fp8_checkpoint.check_sharded(opt, extra["fp8"] or {})
    except fp8_checkpoint.Fp8StateError as exc:
        raise _fail(f"['param_groups'][0][{EXTRA!r}]['fp8']", str(exc)) from None
    return {"copies": copies, "fp8_copies": fp8_copies, "step": step, "groups": updates,
            "scaler": extra["loss_scaler"], "clip_grad": extra["clip_grad"],
            "grad_norm_skip_threshold": extra["grad_norm_skip_threshold"]}


def _local_part(value: Any, where: str, place, owned, dtype: torch.dtype,
                nonnegative: bool) -> Optional[torch.Tensor]:
    """This rank's flattened range of one entry, validated; None where this rank owns none of the param."""
    size = 0 if owned is None else owned.param_end - owned.param_start
    like = torch.empty(size, dtype=dtype, device="meta")
    if hasattr(value, "local_shards"):  # a ShardedTensor (what DCP loaded into this rank's template)
        if global_shape(value) != tuple(place.shape):
            raise _fail(where, f"has global shape {global_shape(value)}, the param {tuple(place.shape)}")
        pieces = local_boxes(value)
        expected = [] if owned is None else boxes(place.shape, owned.param_start, owned.param_end)
        if [box for box, _ in pieces] != expected:
            raise _fail(where, f"holds pieces {[box for box, _ in pieces]} on this rank, expected {expected} (this "
                               "rank's range of the param: build the state dict to load into with get_state_dict)")
        if owned is None:
            return None
        for box, tensor in pieces:
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != box[1]:
                raise _fail(where, f"has a piece at {box[0]} that is not a tensor of shape {box[1]}")
        value = torch.cat([t.reshape(-1) for _, t in pieces]) if len(pieces) > 1 else pieces[0][1].reshape(-1)
    elif isinstance(value, torch.Tensor) and not hasattr(value, "_local_tensor"):
        if tuple(value.shape) != tuple(place.shape):
            raise _fail(where, f"has shape {tuple(value.shape)}, the param {tuple(place.shape)}")
        if owned is None:
            return None
        value = value.reshape(-1)[owned.param_start:owned.param_end]
    else:
        raise _fail(where, f"must be a tensor of the param's shape or a ShardedTensor, got {type(value).__name__}")
    return check_tensor(value, where, like, nonnegative=nonnegative)


def _hyperparameters(saved: Mapping, group: dict) -> dict:
    """A saved group's values for ``check_param_groups``: its bookkeeping out, the live group's param names in
    (paired by position, as torch does: DCP and torch's functions rename params freely, e.g. DDP's
    ``module.``), and an empty dict the live group holds (``overrides``) where the saved one lacks it: torch's
    full_state_dict load path drops empty dicts."""
    values = {k: v for k, v in saved.items() if k not in _GROUP_BOOKKEEPING}
    for key, live in group.items():
        if isinstance(live, Mapping) and not live and key not in values:
            values[key] = {}
    return {**values, "param_names": group.get("param_names")}


def _one_step(opt, steps: list) -> torch.Tensor:
    """graphstep keeps one step count for every param: the entries' must agree."""
    if not steps:
        raise _fail("['state']", "holds no param's 'step'")
    first_where, first = steps[0]
    for where, value in steps:
        check_step(value, f"{where}['step']", opt.tensors.step)
        if not torch.equal(value, first):
            raise _fail(f"{where}['step']", f"is {float(value)}, {first_where}['step'] is {float(first)}: graphstep "
                                            "keeps one step count for every param")
    return first


def _extra(opt, saved_groups) -> dict:
    where = f"['param_groups'][0][{EXTRA!r}]"
    if not isinstance(saved_groups[0], Mapping) or EXTRA not in saved_groups[0]:
        raise _fail(where, "is missing: graphstep's step-wide state (clip_grad, grad_norm_skip_threshold, the loss "
                           "scaler) rides in every param group; this state dict was not saved from a graphstep "
                           "optimizer")
    return check_mapping(saved_groups[0][EXTRA], where, _EXTRA_KEYS, allowed=_EXTRA_KEYS)
