"""The FSDP2 optimizer's state in torch's own format, so that torch.distributed.checkpoint's ``get_state_dict`` /
``set_state_dict`` (and ``dcp.save`` / ``dcp.load`` of ``{"model", "optimizer"}``) save, load and reshard it.

``state_dict()`` is ``torch.optim.Optimizer``'s shape; each state is a DTensor placed like its param whose local
tensor is a *copy* of graphstep's flat state: DCP's in-place load writes into the copies, and only
``load_state_dict``, after checking all of it (graphstep/checkpoint/checks.py) with the mesh's ranks agreeing,
copies them into the buffers, in place. Step-wide values ride in every group under ``"graphstep"``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.checks import (StateDictError, apply_common, check_mapping, check_param_groups, check_scaler,
                                 check_step, check_tensor, check_thresholds, refuse_over)
from ..checkpoint.view import CheckpointView
from ..families import state_spec
from .shards import LocalShard

_EXTRA = "graphstep"
_EXTRA_KEYS = ("clip_grad", "grad_norm_skip_threshold", "loss_scaler")
_GROUP_BOOKKEEPING = ("params", "param_names")  # a group's identity: the live group's, never loaded
_WHERE = "FSDP2 optimizer state dict"  # how every message names what is loaded


def _state_places(view: CheckpointView, index: int) -> dict[str, tuple[int, int, int]]:
    """(buffer, start, size) of each state param ``index`` (layout order) keeps, in shard coordinates: the flat
    buffer's, as graphstep shards nothing itself here (one data-parallel rank)."""
    buffers, place = view.buffers, view.layout.params[index]
    return {name: (place.buffer, place.start, place.numel) for name in buffers.state
            if buffers.keeps_state(name, place.buffer, place.start, place.numel)}


def _state_values(view: CheckpointView, index: int, shard: LocalShard) -> dict[str, torch.Tensor]:
    """The local state tensors of param ``index``, its real rows, as copies (fp32 values of a state stored below
    fp32, ``use_precision_aware_optimizer``): a load writes them, never the live buffers."""
    return {name: shard.real_rows(view.buffers.read_part(name, *where)).clone()
            for name, where in _state_places(view, index).items()}


def _as_dtensor(local: torch.Tensor, shard: LocalShard):
    return shard.fsdp_param.to_sharded_dtensor(local)


def entries(view: CheckpointView) -> dict:
    """torch's optimizer format of the FSDP2 optimizer ``view`` shows (see the module docstring)."""
    position = {id(s.param): i for i, s in enumerate(view.local_shards)}
    order = [position[id(p)] for group in view.param_groups for p in group["params"]]
    state = {}
    for key, index in enumerate(order):
        shard = view.local_shards[index]
        entry = {"step": view.step.clone()}
        entry.update({name: _as_dtensor(values, shard) for name, values in _state_values(view, index, shard).items()})
        state[key] = entry
    clip_grad, skip_threshold = view.thresholds()
    extra = {"clip_grad": clip_grad, "grad_norm_skip_threshold": skip_threshold,
             "loss_scaler": None if view.scaler is None else view.scaler.state_dict()}
    groups, key = [], 0
    for group in view.param_groups:
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = list(range(key, key + len(group["params"])))
        saved[_EXTRA] = copy.deepcopy(extra)
        key += len(group["params"])
        groups.append(saved)
    return {"state": state, "param_groups": groups}


def _local(value: Any) -> Any:
    """A DTensor's local tensor; anything else as it is (for the checks to judge)."""
    return value._local_tensor if hasattr(value, "_local_tensor") else value


@dataclasses.dataclass
class _Plan:
    """What a validated load copies: (state name, (buffer, start, size), shard, source) per state tensor, then
    the step-wide values."""
    copies: list
    step: torch.Tensor
    groups: list
    scaler: Any
    clip_grad: Any
    grad_norm_skip_threshold: Any


def _validate(view: CheckpointView, state_dict: Any, group_problem) -> _Plan:
    """Every check of a load, nothing copied: the state dict's structure, each state tensor (this rank's shard's
    shape, dtype, finite, a second moment >= 0, as the other formats check them), one step count, the groups'
    hyperparameters, the loss scaler and the step-wide thresholds."""
    if not isinstance(state_dict, Mapping) or set(state_dict) != {"state", "param_groups"}:
        raise StateDictError("FSDP2 optimizer state dict: expected torch's format, a dict with 'state' and "
                             "'param_groups' (what opt.state_dict() and torch's get_optimizer_state_dict return)")
    saved_groups, state = state_dict["param_groups"], state_dict["state"]
    check_mapping(state, f"{_WHERE}: ['state']")
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(view.param_groups) or any(
            not isinstance(s, Mapping) or not isinstance(s.get("params"), (list, tuple))
            or len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, view.param_groups)):
        raise StateDictError("FSDP2 optimizer state dict: its param groups do not match the optimizer's (number "
                             "of groups and of params in each)")
    position = {id(s.param): i for i, s in enumerate(view.local_shards)}
    copies, steps = [], []
    for saved_group, group in zip(saved_groups, view.param_groups):
        for key, param in zip(saved_group["params"], group["params"]):  # paired by position, as torch pairs them
            index = position[id(param)]
            shard = view.local_shards[index]
            where = f"{_WHERE}: state[{key!r}]"
            if key not in state:
                raise StateDictError(f"{_WHERE}: no state for param {key!r} ('{shard.name}')")
            entry = check_mapping(state[key], where)
            if "step" in entry:
                steps.append((where, _local(entry["step"])))
            for name, place in _state_places(view, index).items():
                copies.append((name, place, shard, _check_state(view.buffers, entry, name, place, shard, where)))
    return _Plan(copies, _one_step(view.step, steps), *_step_wide(view, saved_groups, group_problem))


def _check_state(buffers, entry: Mapping, name: str, place, shard: LocalShard, where: str) -> torch.Tensor:
    """State ``name`` of ``entry`` (a DTensor's local tensor or a plain tensor), checked as graphstep's flat and
    reshardable formats check it (graphstep/checkpoint/checks.py ``check_tensor``)."""
    if name not in entry:
        raise StateDictError(f"{where} has no {name!r} (param '{shard.name}')")
    source = _local(entry[name])
    if isinstance(source, torch.Tensor) and tuple(source.shape) != shard.real_shape:
        raise StateDictError(f"{where}[{name!r}] has local shape {tuple(source.shape)}, this rank's shard of param "
                             f"'{shard.name}' is {shard.real_shape}")
    where = f"{where}[{name!r}] (param '{shard.name}')"
    like = torch.empty(shard.real_shape, dtype=buffers.shard_like(name, place[0]).dtype, device="meta")
    return check_tensor(source, where, like, nonnegative=state_spec(name).nonnegative)


def _one_step(step_like: torch.Tensor, steps: list) -> torch.Tensor:
    """graphstep keeps one step count for every param: each entry's a valid count, and all of them equal."""
    if not steps:
        raise StateDictError(f"{_WHERE}: no 'step' in its state")
    first_where, first = steps[0]
    for where, step in steps:
        check_step(step, f"{where}['step']", step_like)
        if not torch.equal(step, first):
            raise StateDictError(f"load_state_dict: {where}['step'] is {float(step)}, {first_where}['step'] is "
                                 f"{float(first)}: graphstep keeps one step count for every param")
    return first


def _step_wide(view: CheckpointView, saved_groups, group_problem) -> tuple:
    """(the groups' hyperparameters to set, the scaler state, clip_grad, grad_norm_skip_threshold), checked.

    The keys a live group holds are checked as graphstep's other formats check them (a key the checkpoint
    lacks keeps its value: a ``torch.optim`` optimizer's state dict has graphstep's schedule keys in none of its
    groups). Keys only the checkpoint has (torch's ``amsgrad``, ``foreach``, ...) are set as torch sets them,
    and refused here if the next step would refuse them (``maximize=True``: graphstep/state/group_watch.py).
    Without graphstep's step-wide entry (a torch optimizer's state dict) the thresholds stay as they are."""
    known = [{**{k: v for k, v in group.items() if k != "params"},
              **{k: v for k, v in saved.items() if k in group and k not in _GROUP_BOOKKEEPING}}
             for saved, group in zip(saved_groups, view.param_groups)]
    updates = check_param_groups(view, known, f"{_WHERE}: ['param_groups']", check_indices=False)
    for values, saved, group in zip(updates, saved_groups, view.param_groups):
        values.update({k: v for k, v in saved.items() if k not in group and k not in (*_GROUP_BOOKKEEPING, _EXTRA)})
    problem = group_problem([{**group, **values} for group, values in zip(view.param_groups, updates)])
    if problem is not None:
        raise StateDictError(f"{_WHERE}: {problem}")
    where = f"{_WHERE}: ['param_groups'][0][{_EXTRA!r}]"
    extra = saved_groups[0].get(_EXTRA)
    if extra is None:
        check_scaler(view.scaler, None, f"{where}['loss_scaler']")
        return (updates, None, *view.thresholds())
    check_mapping(extra, where, _EXTRA_KEYS, allowed=_EXTRA_KEYS)
    check_scaler(view.scaler, extra["loss_scaler"], f"{where}['loss_scaler']")
    check_thresholds(extra["clip_grad"], extra["grad_norm_skip_threshold"], where)
    return updates, extra["loss_scaler"], extra["clip_grad"], extra["grad_norm_skip_threshold"]


@torch.no_grad()
def load(view: CheckpointView, state_dict: Any, *, mesh_group, group_problem) -> None:
    """Check everything on every rank of ``mesh_group`` (refusing together; None: one rank), then copy into the
    buffers in place. ``group_problem(groups)``: what the next step would refuse in the loaded param groups, or
    None. A refused load raises ``StateDictError`` naming the param and field; nothing has changed on any rank."""
    refusal = "load_state_dict: rank {rank} refused its part of the FSDP2 optimizer state dict"
    plan = refuse_over(mesh_group, lambda: _validate(view, state_dict, group_problem), view.step.device,
                       dist.get_rank(), refusal)
    for name, (buffer, start, size), shard, source in plan.copies:
        values = view.buffers.read_part(name, buffer, start, size)  # the buffer's own view where full precision
        if values.data_ptr() != source.data_ptr():  # DCP may have loaded into that very view
            shard.real_rows(values).copy_(source)
            view.buffers.write_part(name, buffer, start, size, values)
    apply_common(view, plan.step, plan.groups, plan.scaler, plan.clip_grad, plan.grad_norm_skip_threshold)
