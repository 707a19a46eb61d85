"""The engine beside torch's ``DistributedDataParallel``: what is supported, refused, and warned about.

- DDP with ``use_distributed_optimizer=False`` is supported: DDP averages the grads across ranks and every
  rank runs the whole step. DDP writes the averaged grads back into ``.grad`` at the end of backward,
  after the folded norm's hooks ran, so a grad folded in backward would be folded again before the step
  (the norm computed twice). Once DDP is seen, the fold runs only right before the step: once.
- DDP with ``use_distributed_optimizer=True`` is refused: graphstep's distributed optimizer reduce-scatters
  the grads itself, and DDP's all-reduce would average them a second time.
- Several ranks with neither DDP nor the distributed optimizer train apart, each on its own grads: warned
  once (a job may do that on purpose: independent runs per rank).

Seeing DDP. A model handed over already wrapped (``get_optimizer(config, DDP(model))``) is known at build.
A bare model that DDP wraps later is seen at its first forward: DDP runs the wrapped module's forward
with ``DistributedDataParallel._active_ddp_module`` set (a torch attribute, read defensively: where a
torch version lacks it, nothing is decided and nothing is warned), which a forward pre-hook on each model
chunk reads once and removes itself.
"""

from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import weak_hooks

_ACTIVE = "_active_ddp_module"
_DOUBLE_AVERAGE = ("graphstep: the model runs under DistributedDataParallel and the optimizer has "
                   "use_distributed_optimizer=True: the distributed optimizer reduce-scatters the grads itself, so "
                   "DDP's all-reduce would average them twice. Give graphstep the bare model (without DDP): its "
                   "distributed optimizer does the data-parallel reduction; or keep DDP and set "
                   "use_distributed_optimizer=False")


def _wrapped(chunks: Sequence[torch.nn.Module]) -> bool:
    return any(isinstance(m, DistributedDataParallel) for chunk in chunks for m in chunk.modules())


def check_at_build(chunks: Sequence[torch.nn.Module], distributed_optimizer: bool) -> None:
    """Refuse a model handed over inside DDP with the distributed optimizer, before anything is built."""
    if distributed_optimizer and _wrapped(chunks):
        raise ValueError(_DOUBLE_AVERAGE)


def _wraps(ddp, chunk: torch.nn.Module) -> bool:
    return ddp is not None and any(m is chunk for m in ddp.modules())


class DdpWatch:
    """Decides whether DDP reduces this model's grads (``under_ddp``), refusing or warning as above.
    ``on_ddp``: called once when DDP is seen (the engine moves the fold to the step)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], *, distributed_optimizer: bool, explicit_groups: bool,
                 on_ddp: Callable[[], None]):
        self.under_ddp = False
        self._distributed_optimizer = distributed_optimizer
        self._on_ddp = on_ddp
        self._chunks = list(chunks)
        self._handles = weak_hooks.Handles(self)
        if _wrapped(chunks):  # with the distributed optimizer refused already (check_at_build)
            self._seen(True)
            return
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # With explicit process groups the caller laid out its own parallelism (say tensor-parallel ranks that
        # share data): no warning about ranks training apart.
        self._warn_alone = several and not distributed_optimizer and not explicit_groups
        if several and hasattr(DistributedDataParallel, _ACTIVE):
            for chunk in self._chunks:
                self._handles.append(chunk.register_forward_pre_hook(weak_hooks.calling(self, "_first_forward",
                                                                                       chunk)))

    def _first_forward(self, chunk: torch.nn.Module, module, args) -> None:
        self._handles.remove()
        self._seen(_wraps(getattr(DistributedDataParallel, _ACTIVE, None), chunk))

    def _seen(self, under_ddp: bool) -> None:
        if under_ddp and self._distributed_optimizer:
            raise RuntimeError(_DOUBLE_AVERAGE)
        if under_ddp:
            self.under_ddp = True
            self._on_ddp()
        elif self._warn_alone:
            warnings.warn(
                f"graphstep: this process is one of {dist.get_world_size()} ranks, but its model runs without "
                "DistributedDataParallel and the optimizer without use_distributed_optimizer=True: each rank "
                "steps on its own grads and the ranks train apart. Wrap the model in DDP (with "
                "use_distributed_optimizer=False), or set use_distributed_optimizer=True and give graphstep the "
                "bare model", RuntimeWarning, stacklevel=4)

    def remove(self) -> None:
        self._handles.remove()
