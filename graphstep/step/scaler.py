"""Loss scalers with their state on the device: a constant scale, and Megatron-Core's dynamic rule.

``update(found_inf)`` is pure tensor arithmetic, in place, with no host read, so it runs inside a captured step;
``scale`` and ``inv_scale`` are 0-d fp32 tensors whose addresses never change. The dynamic rule (Megatron-Core's
``DynamicGradScaler``): a non-finite step resets the growth tracker and drops the hysteresis tracker by one; at
or below 0 the scale backs off (× ``backoff_factor``, never below ``min_scale``) on every further non-finite step.
``growth_interval`` clean steps refill the hysteresis and grow the scale (× ``growth_factor``). Unlike
Megatron-Core, growth stops at ``MAX_LOSS_SCALE`` = 2**127: uncapped, a long clean stretch would reach ``inf``
and skip every later step for good (torch's ``GradScaler`` refuses such growth too).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..config import MAX_LOSS_SCALE, MIN_LOSS_SCALE
from . import compiled_scalar_math
from .norm_prescale import FromScale, prescales_at


def _scalar(value: float, device) -> torch.Tensor:
    return torch.full((), float(value), dtype=torch.float32, device=device)


def _is_scale(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and MIN_LOSS_SCALE <= value <= MAX_LOSS_SCALE


def _check_found_inf(found_inf: torch.Tensor) -> None:
    # Metadata only (shape, dtype): reading them is free and never syncs with the device.
    if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1 or not found_inf.is_floating_point():
        raise TypeError(f"loss scaler update: found_inf must be a one-element float tensor (1.0 = non-finite "
                        f"grads), got {found_inf!r:.80}")


def _checked_values(target: dict, state_dict, owner: str, integer_keys: tuple = ()) -> dict:
    """The state dict's values as Python floats, after checking all of them (nothing is copied here).

    Keys must match ``target`` exactly; each value is a number or a one-element real tensor; the scale lies
    in [2**-126, 2**127]; the trackers are whole numbers (the growth tracker >= 0). A ValueError names the key.
    Reading the values on the host is fine here: loading happens between steps, never inside one.
    """
    if not isinstance(state_dict, dict):
        raise ValueError(f"{owner}.load_state_dict: expected a dict with keys {sorted(target)}, got "
                         f"{type(state_dict).__name__}")
    missing = sorted(set(target) - set(state_dict))
    unknown = sorted(set(state_dict) - set(target), key=repr)
    if missing or unknown:
        raise ValueError(f"{owner}.load_state_dict: missing {missing}, unknown {unknown}; expected keys "
                         f"{sorted(target)}")
    values = {}
    for key in target:
        value = state_dict[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() \
                and value.dtype != torch.bool:
            value = value.detach().reshape(()).item()  # load_state_dict, outside any step: a host read is fine
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{owner}.load_state_dict: '{key}' must be a number or a one-element real tensor, "
                             f"got {value!r:.80}")
        value = float(value)
        if key == "scale" and not _is_scale(value):
            raise ValueError(f"{owner}.load_state_dict: 'scale'={value!r} must lie in [2**-126, 2**127]")
        if key in integer_keys and not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"{owner}.load_state_dict: '{key}'={value!r} must be a whole number")
        if key == "growth_tracker" and value < 0:
            raise ValueError(f"{owner}.load_state_dict: 'growth_tracker'={value!r} must be >= 0")
        values[key] = value
    return values


def _load(target: dict, state_dict, owner: str, integer_keys: tuple = ()) -> dict:
    """Check everything, then copy into ``target``'s tensors in place (addresses stay: they may be in a
    graph). A refused state dict leaves the scaler unchanged. Returns the values copied, as Python floats."""
    values = _checked_values(target, state_dict, owner, integer_keys)
    for key, tensor in target.items():
        tensor.fill_(values[key])
    return values


class ConstantLossScaler:
    """A fixed loss scale (``OptimizerConfig.loss_scale``)."""

    prescales_norm: bool
    """Host flag: the norm divides the grads by this scale's power of two (graphstep/step/norm_prescale.py);
    known on the host, so that a scale inside the norm's band costs the step nothing."""

    def __init__(self, scale: float, device):
        if not _is_scale(scale):
            raise ValueError(f"ConstantLossScaler: scale={scale!r}: must be a number in [2**-126, 2**127] "
                             "(scale and 1 / scale finite in float32)")
        self.scale = _scalar(scale, device)
        self.inv_scale = torch.reciprocal(self.scale)  # what load_state_dict and the rule compute: fp32
        self.prescales_norm = prescales_at(scale)
        self._norm_prescale: Optional[FromScale] = None

    def keep_norm_prescale(self, row: torch.Tensor) -> None:
        """Keep ``row`` (the norm's prescale, graphstep/step/norm_prescale.py) that of this scale, now and after
        every change of it."""
        self._norm_prescale = FromScale(row, self.inv_scale)
        self._norm_prescale()

    def update(self, found_inf: torch.Tensor, *, compiled: bool = False) -> None:
        """Nothing changes: a constant scale (the step still skips a non-finite update by itself)."""
        _check_found_inf(found_inf)

    def state_dict(self) -> dict:
        return {"scale": self.scale.clone()}

    def _targets(self) -> dict:
        return {"scale": self.scale}

    def validate_state_dict(self, state_dict: dict) -> None:
        """Raise ValueError naming the key if ``load_state_dict(state_dict)`` would refuse it; change nothing."""
        _checked_values(self._targets(), state_dict, "ConstantLossScaler")

    def load_state_dict(self, state_dict: dict) -> None:
        """Validate everything, then copy in place; a refused state dict changes nothing."""
        values = _load(self._targets(), state_dict, "ConstantLossScaler")
        torch.reciprocal(self.scale, out=self.inv_scale)
        self.prescales_norm = prescales_at(values["scale"])  # a flip recaptures: the norm stage reports it
        if self._norm_prescale is not None:
            self._norm_prescale()


_TRACKERS = ("growth_tracker", "hysteresis_tracker")


_RULE_SETTINGS = ("min_scale", "growth_interval", "hysteresis", "growth_factor", "backoff_factor")


class DynamicLossScaler:
    """Megatron-Core's dynamic loss scale, decided on device. The rule's settings (``_RULE_SETTINGS``) are
    fixed at construction: they are copied to the device there, and assigning one later raises."""

    prescales_norm = True
    """Host flag: the norm may divide the grads by this scale's power of two (graphstep/step/norm_prescale.py):
    the scale lives on the device, so the step always makes the (flag-guarded) calls."""

    def __init__(self, initial_scale: float, min_scale: float, growth_interval: int, hysteresis: int, device,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        if not _is_scale(initial_scale) or not _is_scale(min_scale):
            raise ValueError(f"DynamicLossScaler: initial_scale={initial_scale}, min_scale={min_scale}: both "
                             "numbers in [2**-126, 2**127] (MIN_LOSS_SCALE, MAX_LOSS_SCALE: 1 / scale and scale stay "
                             "finite in float32)")
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
        self.inv_scale = torch.reciprocal(self.scale)
        self.growth_tracker = _scalar(0, device)
        self.hysteresis_tracker = _scalar(hysteresis, device)
        # The rule's constants as fp32 device values (each a float32 either way: a Python float in an op with
        # an fp32 tensor is rounded to fp32), so that one compiled rule serves every scaler in the process.
        self._constants = torch.tensor([self.growth_interval, self.hysteresis, self.growth_factor,
                                        self.backoff_factor, self.min_scale], dtype=torch.float32, device=device)
        self._norm_prescale: Optional[FromScale] = None

    def keep_norm_prescale(self, row: torch.Tensor) -> None:
        """Keep ``row`` (the norm's prescale, graphstep/step/norm_prescale.py) that of this scale, now and after
        every change of it (each update, in the step, and each load)."""
        self._norm_prescale = FromScale(row, self.inv_scale)
        self._norm_prescale()

    def __setattr__(self, name: str, value) -> None:
        if name in _RULE_SETTINGS and name in self.__dict__:
            raise AttributeError(f"DynamicLossScaler.{name} is fixed at construction (the rule reads a device copy "
                                 "made there): build a new scaler to change it")
        super().__setattr__(name, value)

    def update(self, found_inf: torch.Tensor, *, compiled: bool = False) -> None:
        """Advance the rule by one step; ``found_inf`` is a 0-d tensor, non-zero for a non-finite step.

        Every branch of the rule is computed and the right one selected with ``torch.where``, so the same
        ops run whatever the value of ``found_inf``: a captured graph replays it correctly. ``compiled``: the
        rule as one compiled graph (graphstep/step/compiled_scalar_math.py), as the engine runs it where it compiles.
        """
        _check_found_inf(found_inf)
        _DYNAMIC_RULE([self.scale, self.growth_tracker, self.hysteresis_tracker, self.inv_scale],
                      [found_inf, self._constants], compiled=compiled)
        if self._norm_prescale is not None:
            self._norm_prescale()

    def state_dict(self) -> dict:
        return {"scale": self.scale.clone(), "growth_tracker": self.growth_tracker.clone(),
                "hysteresis_tracker": self.hysteresis_tracker.clone()}

    def _targets(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def validate_state_dict(self, state_dict: dict) -> None:
        """Raise ValueError naming the key if ``load_state_dict(state_dict)`` would refuse it; change nothing."""
        _checked_values(self._targets(), state_dict, "DynamicLossScaler", _TRACKERS)

    def load_state_dict(self, state_dict: dict) -> None:
        """Validate everything, then copy in place; a refused state dict changes nothing."""
        _load(self._targets(), state_dict, "DynamicLossScaler", _TRACKERS)
        torch.reciprocal(self.scale, out=self.inv_scale)
        if self._norm_prescale is not None:
            self._norm_prescale()


def scaler_from_config(config, device) -> Optional[ConstantLossScaler | DynamicLossScaler]:
    """Megatron-Core's choice: ``loss_scale`` set → constant; fp16 → dynamic; otherwise no scaling."""
    if config.loss_scale is not None:
        return ConstantLossScaler(config.loss_scale, device)
    if config.fp16:
        return DynamicLossScaler(config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window,
                                 config.hysteresis, device)
    return None


def _dynamic_rule(outs, ins) -> None:
    """``DynamicLossScaler.update``'s math (the module docstring's rule)."""
    scale, growth_tracker, hysteresis_tracker, inv_scale = outs
    found_inf, constants = ins
    growth_interval, hysteresis, growth_factor, backoff_factor, min_scale = constants.unbind()
    bad = found_inf.reshape(()) > 0
    hysteresis_left = torch.where(bad, hysteresis_tracker - 1, hysteresis_tracker)
    growth = torch.where(bad, torch.zeros_like(growth_tracker), growth_tracker + 1)
    grow = growth >= growth_interval
    back_off = bad & (hysteresis_left <= 0)
    backed_off = torch.clamp(scale * backoff_factor, min=min_scale)
    # Capped: an overflowing product is inf, and clamp turns it into MAX_LOSS_SCALE (module docstring).
    grown = torch.clamp(scale * growth_factor, max=MAX_LOSS_SCALE)
    scale.copy_(torch.where(back_off, backed_off, torch.where(grow, grown, scale)))
    hysteresis_tracker.copy_(torch.where(grow, hysteresis, hysteresis_left))
    growth_tracker.copy_(torch.where(grow, torch.zeros_like(growth), growth))
    torch.reciprocal(scale, out=inv_scale)


_DYNAMIC_RULE = compiled_scalar_math.register("dynamic_loss_scale", _dynamic_rule)
