"""What a captured iteration baked in from the model's modules, read cheaply before each run.

A graph replays the forward as it ran at capture: with dropout on or off as ``module.training`` said then,
and calling exactly the hooks that were registered then. So before each run the iteration reads

- the training flags of every module (``mode()``): a model switched between train() and eval() runs another
  graph (each mode is captured once, on first sight, and kept);
- the hooks registered on the modules and torch's global module hooks (``hooks()``): a hook added or removed
  after a capture makes the iteration capture again, so the new hook runs (a replay would silently skip it).

The modules are listed once, at construction: a submodule added later is part of the forward's Python, which a
graph runs once (documented as captured once). Hooks on tensors (``Tensor.register_hook``) are not seen.
"""
from __future__ import annotations

import torch
from torch.nn.modules import module as module_mod

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                      "_global_backward_pre_hooks")


class ModelWatch:
    def __init__(self, model: torch.nn.Module):
        self._modules = tuple(model.modules())

    def mode(self) -> tuple:
        """Every module's ``training`` flag, in ``modules()`` order."""
        return tuple(m.training for m in self._modules)

    def hooks(self) -> tuple:
        """The ids of every module hook (torch numbers each registration afresh: a change is a new id)."""
        local = tuple(tuple(getattr(m, name, {}) or ()) for m in self._modules for name in _HOOK_DICTS)
        return local + tuple(tuple(getattr(module_mod, name, {}) or ()) for name in _GLOBAL_HOOK_DICTS)

    def named_buffers(self) -> dict:
        """The modules' buffers (running statistics, masks) by name: static inputs a capture guards."""
        return {f"model buffer {i}.{name}": b for i, m in enumerate(self._modules)
                for name, b in m.named_buffers(recurse=False)}
