"""torch's optimizer format for a graphstep optimizer, so that torch.distributed.checkpoint.state_dict's
``get_state_dict`` / ``set_state_dict`` save, load and reshard it like a ``torch.optim`` optimizer's
(FSDP2's optimizer has its own: graphstep/fsdp2/state_dict.py).

The format is ``torch.optim.Optimizer.state_dict()``'s; per param: ``"step"``, each state its family keeps, and
``"fp32_param"`` where the main params are not the model params. Under sharding an entry is a ``ShardedTensor``
of the whole param's shape (``param_pieces.py``), which DCP reshards to any size; step-wide values ride in every
group under ``"graphstep"``. The entries are copies, validated on every rank before anything is copied in.

``opt.state_dict()`` must keep giving graphstep's flat format to ``torch.save`` flows, and torch leaves no flag
saying who called: ``torch_api_caller`` tells torch's functions apart by the nearest calling frame outside
graphstep, and reads their ``StateDictOptions`` from those frames by type.
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
from .param_pieces import global_shape, local_boxes, sharded_param
from .torch_entries import ParamEntry, param_entries
from .view import CheckpointView

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
    """torch was asked for full tensors: a ``StateDictOptions(full_state_dict=True)`` among the locals of torch's
    frames up from ``caller`` (the options the user passed to torch's public function, a parameter of it; on its
    full load path torch reads the optimizer's local state dict, to distribute the full one into, under a copy of
    them with the flag cleared). The walk goes through torch's other frames too (its no_grad decorators sit
    between its functions) and stops at the first frame outside torch."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frame = caller
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch."):
        if any(isinstance(value, StateDictOptions) and value.full_state_dict for value in frame.f_locals.values()):
            return True
        frame = frame.f_back
    return False


def is_torch_format(value: Any) -> bool:
    return isinstance(value, Mapping) and set(value) == {"state", "param_groups"}


def _kinds(config, entry: ParamEntry, families) -> tuple[str, ...]:
    """The entries of a param besides its step: its main params where they are not the model param
    (``fp32_param``), then the states its group's family keeps."""
    buffers = entry.domain.buffers
    separate = not buffers.main_is_param[entry.place.buffer] or buffers.host is not None
    return ((MAIN_PARAM,) if separate else ()) + tuple(families[entry.place.group].state_names(config))


def _buffer_kind(kind: str) -> str:
    return "main" if kind == MAIN_PARAM else kind


def _saved_dtype(buffers, kind: str, buffer: int) -> torch.dtype:
    return buffers.shard_like(_buffer_kind(kind), buffer).dtype


def _copy_of(buffers, kind: str, buffer: int, start: int, size: int) -> torch.Tensor:
    part = buffers.read_part(_buffer_kind(kind), buffer, start, size)
    return part if buffers.stored_kind(_buffer_kind(kind), buffer) is not None else part.clone()


def _extras(view: CheckpointView, first: bool) -> dict:
    clip_grad, skip_threshold = view.thresholds()
    return {"clip_grad": clip_grad, "grad_norm_skip_threshold": skip_threshold,
            "loss_scaler": None if view.scaler is None else {k: v.clone() for k, v in view.scaler.state_dict().items()},
            # None, not {}: an empty dict does not survive torch's full_state_dict gather or a DCP round trip.
            "fp8": (fp8_checkpoint.sharded_entries(view.fp8_weights(), snapshot=True) or None) if first else None}


def _refuse_split_fp8(view: CheckpointView, entries: dict, what: str) -> None:
    """The fp8 weights' state is saved whole per param name: a tensor-parallel slice of one would meet its
    peers' under that name."""
    split = [e.place.name for e in entries.values() if e.where.split]
    if split and view.fp8_weights():
        raise NotImplementedError(
            f"{what}: fp8 weights with tensor-parallel slices (e.g. '{split[0]}'): their fp8 state is saved whole "
            "under each param's name, and the slices would overwrite each other. Save each rank's opt.state_dict() "
            "with torch.save")


# ---- get ------------------------------------------------------------------------------------------------
def state_dict(view: CheckpointView, caller: FrameType) -> dict:
    """torch's optimizer format (see the module docstring), for torch's functions."""
    entries = param_entries(view.domains, "get_state_dict", with_grid=True)
    if _wants_full(caller) and any(e.sharded for e in entries.values()):
        raise NotImplementedError(
            "torch's get_state_dict / set_state_dict with StateDictOptions(full_state_dict=True): with the "
            "distributed optimizer or tensor-parallel slices each rank holds only its range of each param's state, "
            "and torch's gather of sharded entries assumes an even split over all ranks. Use the default options "
            "(sharded entries, which DCP saves and reshards to any data-parallel or tensor-parallel size), or "
            "gs.checkpoint.save / load")
    _refuse_split_fp8(view, entries, "get_state_dict")
    view.finish_param_gather()
    families = families_of(view.param_groups, view.config.optimizer)
    state, groups = {}, []
    for g, group in enumerate(view.param_groups):
        saved = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
        saved["params"] = list(range(len(state), len(state) + len(group["params"])))
        saved[EXTRA] = _extras(view, first=g == 0)
        groups.append(saved)
        for p in group["params"]:
            state[len(state)] = _param_entry(view, entries[id(p)], families)
    return {"state": state, "param_groups": groups}


def _param_entry(view: CheckpointView, entry: ParamEntry, families) -> dict:
    """One param's entry: plain tensors of all of it where this rank holds it whole and alone, else
    ShardedTensors of the whole param holding this rank's range of its slice."""
    buffers, place, mine = entry.domain.buffers, entry.place, entry.mine
    out = {"step": view.step.clone()}
    for kind in _kinds(view.config, entry, families):
        local = None
        if mine is not None:
            local = _copy_of(buffers, kind, place.buffer, mine.shard_start, mine.param_end - mine.param_start)
        if not entry.sharded and entry.domain.layout.dp_size > 1:  # a 0-d param: the owner's value, everywhere
            value = local if local is not None else torch.empty((), dtype=_saved_dtype(buffers, kind, place.buffer),
                                                                 device=view.device)
            value = value.to(view.device).view(())
            torch.distributed.broadcast(value, entry.owner_rank(), group=entry.domain.comm.dp_group)
            out[kind] = value
        elif not entry.sharded:
            out[kind] = local.view(place.shape)
        else:
            out[kind] = sharded_param(local, entry.where, _saved_dtype(buffers, kind, place.buffer), entry.owners,
                                      entry.grid, entry.domain.rank, view.device)
    return out


# ---- set ------------------------------------------------------------------------------------------------
def _fail(where: str, problem: str) -> StateDictError:
    return StateDictError(f"{_WHAT} (load_state_dict in torch's format): {where} {problem}")


@torch.no_grad()
def load_state_dict(view: CheckpointView, sd: Mapping) -> None:
    """Validate ``sd`` whole on every data-parallel rank (refusing together), then copy in place and publish
    the params (collective with several ranks). A refused load names the key; nothing changed anywhere."""
    entries = param_entries(view.domains, "set_state_dict", with_grid=False)  # collective: before any rank can refuse
    _refuse_split_fp8(view, entries, "set_state_dict")
    plan = refuse_together(view, lambda: validate(view, sd, entries), "load_state_dict")
    for write in plan["copies"]:
        write()
    apply_common(view, plan["step"], plan["groups"], plan["scaler"], plan["clip_grad"],
                 plan["grad_norm_skip_threshold"])
    view.publish_params()
    fp8_checkpoint.apply(plan["fp8_copies"])  # the saved fp8 bytes and scales replace the publish's recast


def validate(view: CheckpointView, sd: Mapping, entries: dict) -> dict:
    """Every check of a load in torch's format, nothing copied; returns what ``load_state_dict`` copies."""
    saved_groups, state = sd["param_groups"], sd["state"]
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(view.param_groups):
        raise _fail("['param_groups']", f"must be a list of {len(view.param_groups)} groups, one per param group "
                                        "of this optimizer")
    if not isinstance(state, Mapping):
        raise _fail("['state']", f"must be a dict, got {type(state).__name__}")
    families = families_of(view.param_groups, view.config.optimizer)
    copies, steps = [], []
    for g, (saved, group) in enumerate(zip(saved_groups, view.param_groups)):
        keys = saved.get("params") if isinstance(saved, Mapping) else None
        if not isinstance(keys, (list, tuple)) or len(keys) != len(group["params"]):
            raise _fail(f"['param_groups'][{g}]['params']", f"must list the group's {len(group['params'])} params "
                                                             "(saved from another model or other overrides?)")
        if set(saved) == {"params"} and len(group) > 1:
            raise _fail(f"['param_groups'][{g}]", "holds no hyperparameters: torch found none of this group's "
                                                  "params in the saved groups. DCP saves one rank's copy of a "
                                                  "group's entries, so a group whose params differ between ranks "
                                                  "(expert params in a group of their own under expert "
                                                  "parallelism) is found on the ranks whose list was saved only: "
                                                  "keep such params in a group with params every rank holds")
        for key, p in zip(keys, group["params"]):  # paired by position, as torch.optim pairs them
            entry = entries[id(p)]
            where = f"['state'][{key!r}]"
            if key not in state:
                raise _fail(where, f"is missing (the state of param '{entry.place.name}')")
            kinds = _kinds(view.config, entry, families)
            if kinds and isinstance(state[key], Mapping) and set(state[key]) == {"step"}:
                raise _fail(where, f"holds only 'step', not {list(kinds)}. torch's set_state_dict / "
                                   "set_optimizer_state_dict with StateDictOptions(flatten_optimizer_state_dict=True) "
                                   "rebuild only the states opt.state lists, and graphstep's lists the step count "
                                   "only: save and load without that option")
            saved_entry = check_mapping(state[key], where, ("step", *kinds), allowed=("step", *kinds))
            steps.append((where, saved_entry["step"]))
            for kind in kinds:
                nonnegative = kind != MAIN_PARAM and state_spec(kind).nonnegative
                buffers, buffer = entry.domain.buffers, entry.place.buffer
                source = _local_part(saved_entry[kind], f"{where}[{kind!r}]", entry,
                                     _saved_dtype(buffers, kind, buffer), nonnegative)
                if source is not None:
                    copies.append(functools.partial(buffers.write_part, _buffer_kind(kind), buffer,
                                                    entry.mine.shard_start, source.numel(), source))
    step = _one_step(view.step, steps)
    extra = _extra(saved_groups)
    groups = [_hyperparameters(saved, group) for saved, group in zip(saved_groups, view.param_groups)]
    updates = check_param_groups(view, groups, "['param_groups']", check_indices=False)
    check_scaler(view.scaler, extra["loss_scaler"], f"['param_groups'][0][{EXTRA!r}]['loss_scaler']")
    check_thresholds(extra["clip_grad"], extra["grad_norm_skip_threshold"], f"['param_groups'][0][{EXTRA!r}]")
    try:
        fp8_copies = fp8_checkpoint.check_sharded(view.fp8_weights(), extra["fp8"] or {})
    except fp8_checkpoint.Fp8StateError as exc:
        raise _fail(f"['param_groups'][0][{EXTRA!r}]['fp8']", str(exc)) from None
    return {"copies": copies, "fp8_copies": fp8_copies, "step": step, "groups": updates,
            "scaler": extra["loss_scaler"], "clip_grad": extra["clip_grad"],
            "grad_norm_skip_threshold": extra["grad_norm_skip_threshold"]}


def _local_part(value: Any, where: str, entry: ParamEntry, dtype: torch.dtype,
                nonnegative: bool) -> Optional[torch.Tensor]:
    """This rank's flattened range of one entry, validated; None where this rank owns none of the param."""
    owned, whole = entry.mine, entry.where.global_shape
    size = 0 if owned is None else owned.param_end - owned.param_start
    like = torch.empty(size, dtype=dtype, device="meta")
    if hasattr(value, "local_shards"):  # a ShardedTensor (what DCP loaded into this rank's template)
        if global_shape(value) != whole:
            raise _fail(where, f"has global shape {global_shape(value)}, the param {whole}")
        pieces = local_boxes(value)
        expected = [] if owned is None else entry.where.boxes(owned.param_start, owned.param_end)
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
        if tuple(value.shape) != whole:
            raise _fail(where, f"has shape {tuple(value.shape)}, the param {whole}")
        if owned is None:
            return None
        value = entry.where.local_of(value).reshape(-1)[owned.param_start:owned.param_end]
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


def _one_step(step_like: torch.Tensor, steps: list) -> torch.Tensor:
    """graphstep keeps one step count for every param: the entries' must agree."""
    if not steps:
        raise _fail("['state']", "holds no param's 'step'")
    first_where, first = steps[0]
    for where, value in steps:
        check_step(value, f"{where}['step']", step_like)
        if not torch.equal(value, first):
            raise _fail(f"{where}['step']", f"is {float(value)}, {first_where}['step'] is {float(first)}: graphstep "
                                            "keeps one step count for every param")
    return first


def _extra(saved_groups) -> dict:
    where = f"['param_groups'][0][{EXTRA!r}]"
    if not isinstance(saved_groups[0], Mapping) or EXTRA not in saved_groups[0]:
        raise _fail(where, "is missing: graphstep's step-wide state (clip_grad, grad_norm_skip_threshold, the loss "
                           "scaler) rides in every param group; this state dict was not saved from a graphstep "
                           "optimizer")
    return check_mapping(saved_groups[0][EXTRA], where, _EXTRA_KEYS, allowed=_EXTRA_KEYS)
