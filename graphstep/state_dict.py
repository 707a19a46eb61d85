"""The engine's ``state_dict`` / ``load_state_dict``: this rank's flat buffers, exact, for ``torch.save`` flows.

A load copies into the existing static buffers (addresses never change, so a captured step stays valid)
and then refreshes the model params from the main params.
"""

from __future__ import annotations

import torch

STATE_DICT_FORMAT = "graphstep/1"


def state_dict(opt) -> dict:
    """This rank's flat buffers, exact, for ``torch.save`` flows at the same layout."""
    opt.finish_param_gather()
    groups = []
    index = {id(p): i for i, p in enumerate(opt.buffers.params)}
    for group in opt.param_groups:
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = [index[id(p)] for p in group["params"]]
        groups.append(saved)
    return {
        "format": STATE_DICT_FORMAT,
        "layout": opt.layout.fingerprint(),
        "rank": opt.rank,
        "step": opt.tensors.step.clone(),
        "main_params": [m.clone() for m in opt.buffers.main_shard],
        "state": {name: [t.clone() for t in tensors] for name, tensors in opt.buffers.state.items()},
        "param_groups": groups,
        "scaler": None if opt.scaler is None else opt.scaler.state_dict(),
        "clip_grad": opt.clip_grad,
        "grad_norm_skip_threshold": opt.grad_norm_skip_threshold,
    }


@torch.no_grad()
def load_state_dict(opt, state_dict: dict) -> None:
    """Load by copying into the existing buffers (addresses never change), then refresh model params."""
    if state_dict.get("format") != STATE_DICT_FORMAT:
        raise ValueError(f"load_state_dict: format {state_dict.get('format')!r} is not {STATE_DICT_FORMAT!r}")
    if state_dict["layout"] != opt.layout.fingerprint():
        raise ValueError("load_state_dict: the checkpoint was saved for a different layout (other params, "
                         "groups, dtypes or data-parallel size); build the optimizer over the same model "
                         "and config")
    if state_dict["rank"] != opt.rank:
        raise ValueError(f"load_state_dict: checkpoint of rank {state_dict['rank']} loaded on rank {opt.rank}")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"load_state_dict: {len(saved_groups)} param groups saved, {len(opt.param_groups)} here")
    for g, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        if saved.get("param_names") != group.get("param_names"):
            raise ValueError(f"load_state_dict: param group {g} holds other params than the checkpoint's")
    if set(state_dict["state"]) != set(opt.buffers.state):
        raise ValueError(f"load_state_dict: state {sorted(state_dict['state'])} does not match this "
                         f"optimizer's {sorted(opt.buffers.state)}")

    def copy_all(targets, sources, what):
        for b, (target, source) in enumerate(zip(targets, sources, strict=True)):
            if target.shape != source.shape:
                raise ValueError(f"load_state_dict: {what}[{b}] has shape {tuple(source.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(source)

    copy_all(opt.buffers.main_shard, state_dict["main_params"], "main_params")
    for name, tensors in opt.buffers.state.items():
        copy_all(tensors, state_dict["state"][name], name)
    opt.tensors.step.copy_(state_dict["step"])
    if opt.scaler is not None:
        if state_dict["scaler"] is None:
            raise ValueError("load_state_dict: the checkpoint has no loss-scaler state, this optimizer scales")
        opt.scaler.load_state_dict(state_dict["scaler"])
    for group, saved in zip(opt.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    opt.clip_grad = state_dict["clip_grad"]
    opt.grad_norm_skip_threshold = state_dict["grad_norm_skip_threshold"]
    opt.publish_params()
