"""What ``graphstep.wrap`` refuses, and the torch details it works around, as plain functions over param groups.

The refusals run wherever param groups come in: at ``wrap``, at ``add_param_group`` (the new group) and at
``load_state_dict`` (the groups as they will be once loaded), so a setting that would freeze under capture, or
a param torch's fused kernels would step wrongly, is refused at the call that brought it, never at a later
capture with a message about something else.
"""

from __future__ import annotations

import copy

import torch

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
# How torch runs a group's update, as opposed to what the update is. ``wrap`` chose these (or checked them) for
# capture; a loaded state dict keeps this optimizer's, not the saving run's: a non-fused run's (or an older
# torch's, without the keys) would turn the captured step into one that reads the step count or lr on the host.
IMPLEMENTATION_KEYS = ("fused", "capturable", "foreach", "differentiable")


def optimizer_refusals(optimizer: torch.optim.Optimizer) -> list[str]:
    """Why ``optimizer``'s step cannot be captured without freezing something or stepping wrongly; [] if none."""
    if not isinstance(optimizer, SUPPORTED):
        return [f"{type(optimizer).__name__} is not one of Adam, AdamW, SGD"]
    return [reason for g, group in enumerate(optimizer.param_groups)
            for reason in group_refusals(optimizer, g, group)]


def group_refusals(optimizer: torch.optim.Optimizer, g: int, group: dict) -> list[str]:
    """Why param group ``g`` (a dict as torch holds it, defaults filled in) cannot be captured; [] if none."""
    name = type(optimizer).__name__
    reasons = []
    if group.get("differentiable"):
        reasons.append(f"group {g}: differentiable=True builds an autograd graph through the step")
    fused = bool(group.get("fused"))
    capturable = bool(group.get("capturable"))
    on_cpu = any(p.device.type == "cpu" for p in group["params"])
    if isinstance(optimizer, torch.optim.SGD):
        if not fused:
            reasons.append(f"group {g}: {name} without fused=True multiplies by lr as a Python number "
                           "(a tensor lr is read on the host), so lr would freeze; pass fused=True")
    elif not (fused or (capturable and not on_cpu)):
        reasons.append(f"group {g}: {name} without fused=True reads the step count on the host for the bias "
                       "correction, so it would freeze at its capture value; pass fused=True"
                       + ("" if on_cpu else " or capturable=True"))
    if fused:
        for i, p in enumerate(group["params"]):
            if not is_dense(p):
                reasons.append(
                    f"group {g}: param {i} (shape {tuple(p.shape)}, strides {p.stride()}) is not dense in memory: "
                    "torch's fused kernels walk a param's memory as if it were, and would update elements "
                    "outside it and skip some of its own; make it a param of its own, "
                    "e.g. nn.Parameter(p.detach().clone(memory_format=torch.contiguous_format))")
    return reasons


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory span exactly once (contiguous in some order of its dims: a
    transposed or channels-last tensor is; a strided slice or an expanded tensor is not)."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def state_dict_in_this_implementation(state_dict: dict, groups: list[dict]) -> dict:
    """A copy of ``state_dict`` whose param groups take ``IMPLEMENTATION_KEYS`` from ``groups`` (this optimizer's);
    the hyperparameters stay the saved ones. torch's ``load_state_dict`` places each state tensor by the loaded
    group's flags (the Adam step count on the param's device when fused or capturable), so the flags are set
    before it runs, not after."""
    loaded = dict(state_dict)
    if len(state_dict.get("param_groups", ())) != len(groups):
        return loaded  # torch's own check names the mismatch
    loaded["param_groups"] = [copy.copy(saved) for saved in state_dict["param_groups"]]
    for saved, group in zip(loaded["param_groups"], groups):
        for key in IMPLEMENTATION_KEYS:
            if key in group:
                saved[key] = group[key]
            else:
                saved.pop(key, None)
    return loaded


def make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Mark fused Adam/AdamW groups capturable, which torch requires under a CUDA capture and the fused kernel
    ignores (so nothing in the update changes)."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam; SGD runs no such check
        return
    for group in optimizer.param_groups:
        if group.get("fused"):
            group["capturable"] = True


def unhooked_step(optimizer: torch.optim.Optimizer):
    """``optimizer``'s step without torch's hook wrapper (``Optimizer.profile_hook_step``, patched onto the class
    at construction): the wrapping optimizer's own step runs the global and per-optimizer step hooks, once."""
    step = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def share_step_hooks(wrapper: torch.optim.Optimizer, wrapped: torch.optim.Optimizer) -> None:
    """Make ``wrapper`` hold ``wrapped``'s per-optimizer step hooks (the same dicts, so a hook registered on
    either later is in both). torch keeps them in private dicts with no public accessor; these two names are
    what ``register_step_pre_hook`` / ``register_step_post_hook`` and ``profile_hook_step`` use."""
    wrapper._optimizer_step_pre_hooks = wrapped._optimizer_step_pre_hooks
    wrapper._optimizer_step_post_hooks = wrapped._optimizer_step_post_hooks
