"""What an optimizer's checkpoints read and write: the parts of its build record (graphstep/assembly.py ``Build``)
and the live values a user may change, handed over by the engine (``opt.checkpoint_view()``) so that every
checkpoint function says in its signature what it touches, never the whole optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..fp8 import checkpoint as fp8_checkpoint


@dataclass(frozen=True)
class CheckpointView:
    """One optimizer's parts, as its checkpoint formats (flat, reshardable, torch's, FSDP2's) use them."""

    config: Any  # the OptimizerConfig
    param_groups: list  # the live groups (torch's ``Optimizer.param_groups``): a load updates them in place
    domains: tuple  # the dense domain, then the MoE expert params' (graphstep/step/domains.py)
    step: torch.Tensor  # the one step count every param shares
    scaler: Any  # the loss scaler, or None
    comm: Any  # the dense params' collectives
    rank: int  # in the data-parallel group
    device: torch.device
    local_shards: Optional[tuple]  # an FSDP2 model's local shards, else None
    thresholds: Callable[[], tuple]
    """``(clip_grad, grad_norm_skip_threshold)`` as they are now (a user may change them between steps)."""
    set_thresholds: Callable[[Any, Any], None]
    """Sets ``clip_grad`` and ``grad_norm_skip_threshold`` (a load's)."""
    finish_param_gather: Callable[[], None]
    """Waits for deferred all-gathers: a save reads the params' main values after them."""
    publish_params: Callable[[], None]
    """Copies the main params into the model params (collective): a load's last step."""

    @property
    def layout(self):
        """The dense domain's Layout."""
        return self.domains[0].layout

    @property
    def buffers(self):
        """The dense domain's StaticBuffers."""
        return self.domains[0].buffers

    def fp8_weights(self) -> list:
        """(model name, param) of every fp8 weight in the dense params (graphstep/fp8/checkpoint.py ``weights``)."""
        return fp8_checkpoint.weights(self.layout, self.buffers.params)
