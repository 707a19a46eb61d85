"""Where a step runs, in one place: which capture backend a device gets, and the few device-type facts
the rest of the code needs (graphstep/ itself names no accelerator type, docs/design.md law 7; "cpu"
appears there only where host memory is meant, and for CPU-only choices such as the fp64 hyperparameters).

``backend_for(device, mode)`` is the single decision of "how the step runs":

- "graph": a CUDA graph on a CUDA device, the CPU replay backend anywhere else (so every capture test
  runs in CI);
- "auto": a CUDA graph on a CUDA device (after ``capture.check`` finds nothing unsafe); elsewhere the
  step runs eagerly, with the reason returned so the caller can say it once;
- "eager": always eager.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

__all__ = ["MODES", "backend_for", "is_cuda", "synchronize", "device_scope", "accelerator_available"]

MODES = ("auto", "graph", "eager")
_CUDA = "cuda"


def is_cuda(device) -> bool:
    """Whether ``device`` (a torch.device, a string or a tensor) is a CUDA device."""
    if isinstance(device, torch.Tensor):
        device = device.device
    return torch.device(device).type == _CUDA


def backend_for(device, mode: str) -> tuple[str, Optional[str]]:
    """(backend name, why the step stays eager or None) for a step over tensors on ``device``."""
    if mode not in MODES:
        raise ValueError(f"capture mode {mode!r}: must be one of {', '.join(map(repr, MODES))}")
    if mode == "eager":
        return "eager", None
    if is_cuda(device):
        return _CUDA, None
    if mode == "graph":
        return "replay", None
    kind = torch.device(device).type
    return "eager", (f"capture='auto' runs the step eagerly on {kind}: CUDA graphs need a GPU "
                     "(capture='graph' uses the CPU replay backend)")


def synchronize(device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if torch.device(device).type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


def device_scope(device):
    """A context that makes ``device`` current where devices have a notion of "current" (CUDA), so side
    streams and graphs created inside land on it; a no-op elsewhere."""
    if is_cuda(device):
        return torch.cuda.device(torch.device(device))
    return contextlib.nullcontext()


def accelerator_available() -> bool:
    """Whether this torch build has a usable accelerator (pinned host memory needs one)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return accelerator.is_available()
    return torch.cuda.is_available()
