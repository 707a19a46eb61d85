"""Loss scalers with their state on the device: a constant scale, and Megatron-Core's dynamic rule.

``update(found_inf)`` is pure tensor arithmetic, in place, with no host read, so it runs inside a
captured step. ``scale`` and ``inv_scale`` are 0-d fp32 tensors whose addresses never change.

The dynamic rule (Megatron-Core's ``DynamicGradScaler``; shared/reference/megatron-core-notes.md):
on a non-finite step the growth tracker resets to 0 and the hysteresis tracker drops by one; once it is
at or below 0 the scale backs off (× ``backoff_factor``, never below ``min_scale``), and it is not reset,
so each further non-finite step backs off again. On a clean step the growth tracker counts up; at
``growth_interval`` it resets, the hysteresis tracker refills to ``hysteresis`` and the scale grows
(× ``growth_factor``, no upper bound).
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def _scalar(value: float, device) -> torch.Tensor:
    return torch.full((), float(value), dtype=torch.float32, device=device)


def _check_found_inf(found_inf: torch.Tensor) -> None:
    # Metadata only (shape, dtype): reading them is free and never syncs with the device.
    if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1 or not found_inf.is_floating_point():
        raise TypeError(f"loss scaler update: found_inf must be a one-element float tensor (1.0 = non-finite "
                        f"grads), got {found_inf!r:.80}")


def _load(target: dict, state_dict: dict, owner: str) -> None:
    """Copy ``state_dict``'s tensors into ``target``'s in place (addresses stay: they may be in a graph)."""
    missing = sorted(set(target) - set(state_dict))
    unknown = sorted(set(state_dict) - set(target))
    if missing or unknown:
        raise ValueError(f"{owner}.load_state_dict: missing {missing}, unknown {unknown}; expected keys "
                         f"{sorted(target)}")
    for key, tensor in target.items():
        tensor.copy_(torch.as_tensor(state_dict[key]).reshape(()))


class ConstantLossScaler:
    """A fixed loss scale (``OptimizerConfig.loss_scale``)."""

    def __init__(self, scale: float, device):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
            raise ValueError(f"ConstantLossScaler: scale={scale!r}: must be a finite number > 0")
        self.scale = _scalar(scale, device)
        self.inv_scale = _scalar(1.0 / scale, device)

    def update(self, found_inf: torch.Tensor) -> None:
        """Nothing changes: a constant scale (the step still skips a non-finite update by itself)."""
        _check_found_inf(found_inf)

    def state_dict(self) -> dict:
        return {"scale": self.scale.clone()}

    def load_state_dict(self, state_dict: dict) -> None:
        _load({"scale": self.scale}, state_dict, "ConstantLossScaler")
        torch.reciprocal(self.scale, out=self.inv_scale)


class DynamicLossScaler:
    """Megatron-Core's dynamic loss scale, decided on device."""

    def __init__(self, initial_scale: float, min_scale: float, growth_interval: int, hysteresis: int, device,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        if not 0 < initial_scale < math.inf or not 0 < min_scale < math.inf:
            raise ValueError(f"DynamicLossScaler: initial_scale={initial_scale}, min_scale={min_scale}: both "
                             "finite and > 0")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (growth_interval, hysteresis)) \
                or growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"DynamicLossScaler: growth_interval={growth_interval}, hysteresis={hysteresis}: "
                             "both integers >= 1")
        if not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"DynamicLossScaler: growth_factor={growth_factor} must be > 1 and "
                             f"backoff_factor={backoff_factor} in (0, 1)")
        self.min_scale = float(min_scale)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.scale = _scalar(initial_scale, device)
        self.inv_scale = _scalar(1.0 / initial_scale, device)
        self.growth_tracker = _scalar(0, device)
        self.hysteresis_tracker = _scalar(hysteresis, device)

    def update(self, found_inf: torch.Tensor) -> None:
        """Advance the rule by one step; ``found_inf`` is a 0-d tensor, non-zero for a non-finite step.

        Every branch of the rule is computed and the right one selected with ``torch.where``, so the same
        ops run whatever the value of ``found_inf``: a captured graph replays it correctly.
        """
        _check_found_inf(found_inf)
        bad = found_inf.reshape(()) > 0
        hysteresis_left = torch.where(bad, self.hysteresis_tracker - 1, self.hysteresis_tracker)
        growth = torch.where(bad, torch.zeros_like(self.growth_tracker), self.growth_tracker + 1)
        grow = growth >= self.growth_interval
        back_off = bad & (hysteresis_left <= 0)
        backed_off = torch.clamp(self.scale * self.backoff_factor, min=self.min_scale)
        self.scale.copy_(torch.where(back_off, backed_off,
                                     torch.where(grow, self.scale * self.growth_factor, self.scale)))
        self.hysteresis_tracker.copy_(torch.where(grow, torch.full_like(hysteresis_left, self.hysteresis),
                                                  hysteresis_left))
        self.growth_tracker.copy_(torch.where(grow, torch.zeros_like(growth), growth))
        torch.reciprocal(self.scale, out=self.inv_scale)

    def state_dict(self) -> dict:
        return {"scale": self.scale.clone(), "growth_tracker": self.growth_tracker.clone(),
                "hysteresis_tracker": self.hysteresis_tracker.clone()}

    def load_state_dict(self, state_dict: dict) -> None:
        _load({"scale": self.scale, "growth_tracker": self.growth_tracker,
               "hysteresis_tracker": self.hysteresis_tracker}, state_dict, "DynamicLossScaler")
        torch.reciprocal(self.scale, out=self.inv_scale)


def scaler_from_config(config, device) -> Optional[ConstantLossScaler | DynamicLossScaler]:
    """Megatron-Core's choice: ``loss_scale`` set → constant; fp16 → dynamic; otherwise no scaling."""
    if config.loss_scale is not None:
        return ConstantLossScaler(config.loss_scale, device)
    if config.fp16:
        return DynamicLossScaler(config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window,
                                 config.hysteresis, device)
    return None
