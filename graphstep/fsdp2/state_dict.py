"""The FSDP2 optimizer's state in torch's own format, so that torch.distributed.checkpoint's ``get_state_dict`` /
``set_state_dict`` (and ``dcp.save`` / ``dcp.load`` of ``{"model", "optimizer"}``) save, load and reshard it.

``state_dict()`` is ``torch.optim.Optimizer``'s shape: ``{"state": {index: {"step", <state name>: DTensor}},
"param_groups": [{..., "params": [index, ...]}]}``, indices numbering the params in ``param_groups`` order. Each
state tensor is a DTensor placed like its param whose local tensor is a *view* of graphstep's flat state buffer (the
real rows of the padded chunk), so DCP's in-place load writes straight into the buffers; a state stored below fp32
(``use_precision_aware_optimizer``) is an fp32 copy of its values instead, encoded again at load. The step count is
graphstep's one shared tensor. Step-wide values torch has no place for (the loss scaler's tensors) ride along in
every group under ``"graphstep"``, as do ``clip_grad`` and ``grad_norm_skip_threshold``.

``load_state_dict`` takes that shape with int or FQN keys (DCP renames them), pairing saved params with live ones
by position as torch does, checks every shape first and copies in place (nothing is replaced, nothing recaptured).
"""

from __future__ import annotations

import copy

import torch

from ..checkpoint.state_dict import StateDictError
from .shards import LocalShard

_EXTRA = "graphstep"


def _state_places(opt, index: int) -> dict[str, tuple[int, int, int]]:
    """(buffer, start, size) of each state param ``index`` (layout order) keeps, in shard coordinates: the flat
    buffer's, as graphstep shards nothing itself here (one data-parallel rank)."""
    buffers, place = opt.buffers, opt.layout.params[index]
    return {name: (place.buffer, place.start, place.numel) for name in buffers.state
            if buffers.keeps_state(name, place.buffer, place.start, place.numel)}


def _state_values(opt, index: int, shard: LocalShard) -> dict[str, torch.Tensor]:
    """The local state tensors of param ``index``, its real rows: views of the buffers, or fp32 copies of a state
    stored below fp32 (``use_precision_aware_optimizer``)."""
    return {name: shard.real_rows(opt.buffers.read_part(name, *where))
            for name, where in _state_places(opt, index).items()}


def _as_dtensor(local: torch.Tensor, shard: LocalShard):
    return shard.fsdp_param.to_sharded_dtensor(local)


def state_dict(opt) -> dict:
    position = {id(s.param): i for i, s in enumerate(opt.local_shards)}
    order = [position[id(p)] for group in opt.param_groups for p in group["params"]]
    state = {}
    for key, index in enumerate(order):
        shard = opt.local_shards[index]
        entry = {"step": opt.tensors.step}
        entry.update({name: _as_dtensor(values, shard) for name, values in _state_values(opt, index, shard).items()})
        state[key] = entry
    extra = {"clip_grad": opt.clip_grad, "grad_norm_skip_threshold": opt.grad_norm_skip_threshold,
             "loss_scaler": None if opt.scaler is None else opt.scaler.state_dict()}
    groups, key = [], 0
    for group in opt.param_groups:
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = list(range(key, key + len(group["params"])))
        saved[_EXTRA] = copy.deepcopy(extra)
        key += len(group["params"])
        groups.append(saved)
    return {"state": state, "param_groups": groups}


def _local(value, where: str) -> torch.Tensor:
    if hasattr(value, "_local_tensor"):
        return value._local_tensor
    if isinstance(value, torch.Tensor):
        return value
    raise StateDictError(f"{where}: expected a tensor, got {type(value).__name__}")


def load_state_dict(opt, state_dict: dict) -> None:
    if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
        raise StateDictError("FSDP2 optimizer state dict: expected torch's format, a dict with 'state' and "
                             "'param_groups' (what opt.state_dict() and torch's get_optimizer_state_dict return)")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, opt.param_groups)):
        raise StateDictError("FSDP2 optimizer state dict: its param groups do not match the optimizer's (number "
                             "of groups and of params in each)")
    position = {id(s.param): i for i, s in enumerate(opt.local_shards)}
    copies = []
    for saved_group, group in zip(saved_groups, opt.param_groups):
        for key, param in zip(saved_group["params"], group["params"]):
            index = position[id(param)]
            shard = opt.local_shards[index]
            entry = state_dict["state"].get(key)
            if entry is None:
                raise StateDictError(f"FSDP2 optimizer state dict: no state for param {key!r}")
            for name, where in _state_places(opt, index).items():
                if name not in entry:
                    raise StateDictError(f"FSDP2 optimizer state dict: state[{key!r}] has no {name!r}")
                source = _local(entry[name], f"state[{key!r}][{name!r}]")
                if tuple(source.shape) != shard.real_shape:
                    raise StateDictError(f"FSDP2 optimizer state dict: state[{key!r}][{name!r}] has local shape "
                                         f"{tuple(source.shape)}, this rank's shard is {shard.real_shape}")
                copies.append((name, where, shard, source))
    steps = [e["step"] for e in state_dict["state"].values() if "step" in e]
    if not steps:
        raise StateDictError("FSDP2 optimizer state dict: no 'step' in its state")
    extra = saved_groups[0].get(_EXTRA) if saved_groups else None
    if opt.scaler is not None and (extra is None or extra.get("loss_scaler") is None):
        raise StateDictError("FSDP2 optimizer state dict: this optimizer scales the loss, the checkpoint has no "
                             "loss scaler state")
    if opt.scaler is not None:
        opt.scaler.validate_state_dict(extra["loss_scaler"])
    for name, (buffer, start, size), shard, source in copies:
        values = opt.buffers.read_part(name, buffer, start, size)  # the buffer's own view where full precision
        if values.data_ptr() != source.data_ptr():  # DCP may have loaded into that very view
            shard.real_rows(values).copy_(source)
            opt.buffers.write_part(name, buffer, start, size, values)
    opt.tensors.step.copy_(_local(steps[0], "step").reshape(opt.tensors.step.shape))
    for saved_group, group in zip(saved_groups, opt.param_groups):
        group.update({k: copy.deepcopy(v) for k, v in saved_group.items() if k not in ("params", _EXTRA)})
    if extra is not None:
        opt.clip_grad = extra["clip_grad"]
        opt.grad_norm_skip_threshold = extra["grad_norm_skip_threshold"]
        if opt.scaler is not None:
            opt.scaler.load_state_dict(extra["loss_scaler"])
