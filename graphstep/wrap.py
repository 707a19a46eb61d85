"""graphstep.wrap: capture the step of a plain torch.optim optimizer (Adam, AdamW, SGD).

What a capture would freeze in a torch optimizer, and what ``wrap`` does about it:
- ``lr`` as a Python float: converted to a 0-d device tensor that torch's LR schedulers ``fill_`` in
  place (fp64 on the CPU, where torch's scalar math is double, so the result stays bitwise equal).
- the step count: the for-loop and foreach Adam read it on the host for the bias correction; only
  ``fused=True`` (or ``capturable=True`` on a GPU) keeps it on device. Others are refused.
- betas, eps, weight decay, momentum: floats that torch's kernels take as floats; recorded at capture
  and guarded: a change recaptures the step, never freezes it.
- grads: a user's ``zero_grad()`` (set_to_none) makes backward allocate new grad tensors; before each
  step their values are copied into the captured grad tensors and the params pointed back at them.
- state: created by torch on the first step, so at least one warm-up step runs eagerly.
- torch's capture health check: Adam's and AdamW's ``step`` raise under a CUDA capture when a group has
  ``capturable=False``, ``fused=True`` included. The fused kernel ignores the flag (its step count is on
  device either way), so ``wrap`` sets ``capturable=True`` on fused groups, and again after a
  ``load_state_dict`` that brings back a saved ``False``.

With a graphstep loss scaler (``scaler=``), the step checks the grads for inf/NaN on device, hands
``grad_scale``/``found_inf`` to the fused kernel (torch's own AMP protocol, so a skipped step changes
nothing) and updates the scale; without one, a plain bf16 or fp32 loop is captured as is.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from .checkpoint.optimizer_hooks import runs_load_state_dict_hooks, runs_state_dict_hooks
from .hooks.requires_grad_watch import RequiresGradWatch
from .parallel.collectives import Collectives
from .run.runner import StepRunner
from .state.hyperparams import scalar_dtype
from .step.stages import StepTensors
from .step.stages import loss_scale as loss_scale_stage
from .step.stages import norm as norm_stage

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
# Settings each kernel takes as Python values: captured once, guarded before every replay.
_BAKED_KEYS = ("betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "maximize", "amsgrad")


def _make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Mark fused Adam/AdamW groups capturable, which torch requires under a CUDA capture and the fused
    kernel ignores (so nothing in the update changes)."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam; SGD runs no such check
        return
    for group in optimizer.param_groups:
        if group.get("fused"):
            group["capturable"] = True


def _refusals(optimizer: torch.optim.Optimizer) -> list[str]:
    if not isinstance(optimizer, SUPPORTED):
        return [f"{type(optimizer).__name__} is not one of Adam, AdamW, SGD"]
    name = type(optimizer).__name__
    reasons = []
    for g, group in enumerate(optimizer.param_groups):
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
    return reasons


class CapturedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose ``step()`` is captured once and replayed; see ``wrap``.

    It is a ``torch.optim.Optimizer`` over the very same param-group dicts and state as the wrapped one,
    so torch's LR schedulers can drive either.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup: int, scaler, capture_mode: str,
                 invalidation: str):
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # the same dicts, the same list
        self.state = optimizer.state
        self.optimizer = optimizer
        self.scaler = scaler
        params = [p for group in optimizer.param_groups for p in group["params"]]
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"graphstep.wrap: params on several devices {sorted(map(str, devices))}")
        self.device = devices.pop()
        self._params = params
        # A grad set to None becomes a zero grad here (the captured step reads static grads), so a param
        # frozen after wrapping would go on moving under momentum and weight decay: refused by name.
        self._requires_grad = RequiresGradWatch([], [(f"param_groups[{g}]['params'][{i}]", p)
                                                     for g, group in enumerate(optimizer.param_groups)
                                                     for i, p in enumerate(group["params"])])
        _make_capturable(optimizer)
        for group in optimizer.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=scalar_dtype(self.device), device=self.device)
        self._grads: Optional[list[torch.Tensor]] = None
        self.tensors = StepTensors.allocate(self.device, None if scaler is None else scaler.scale,
                                            None if scaler is None else scaler.inv_scale)
        self.found_inf = self.tensors.found_inf
        self.update_successful = self.tensors.update_successful
        self._scale_stages = None  # (norm, loss_scale), built at the first step, once the grads exist
        self._runner = StepRunner(step_fn=self._device_step, mode=capture_mode, device=self.device,
                                  warmup_steps=warmup, invalidation=invalidation,
                                  static_inputs=self._static_inputs, baked_values=self._baked_values)

    @property
    def captured(self) -> bool:
        return self._runner.captured

    @property
    def recaptures(self) -> int:
        """How many times the captured step was captured again after going stale."""
        return self._runner.recaptures

    def close(self) -> None:
        """Release the captured step (graph and memory pool); later steps run eagerly."""
        self._runner.close()

    @runs_state_dict_hooks
    def state_dict(self) -> dict:
        """torch's state dict of the wrapped optimizer, and under ``"scaler"`` the loss scaler's state (its scale
        and trackers: a resume without them would start the loss scale over)."""
        saved = self.optimizer.state_dict()
        if self.scaler is not None:
            saved["scaler"] = self.scaler.state_dict()
        return saved

    @runs_load_state_dict_hooks
    def load_state_dict(self, state_dict: dict) -> None:
        """Loads through torch, then puts this optimizer's own param-group dicts and lr tensors back; the loss
        scaler's state is validated before anything is loaded and loaded after torch's part.

        torch's ``load_state_dict`` replaces the wrapped optimizer's ``param_groups`` (new dicts, new lr
        tensors) and ``state``. A scheduler holds the old dicts and would keep writing lr tensors the step
        no longer reads, freezing the lr. So the loaded values are copied into the original dicts (the lr
        into the original tensor, in place), the wrapped optimizer is pointed back at them, and the state
        is shared again. The state tensors are new: the next step recaptures.
        """
        scaler_state = state_dict.get("scaler")
        if (scaler_state is None) != (self.scaler is None):
            raise ValueError("graphstep.wrap: load_state_dict: " + (
                "the state dict holds no loss-scaler state (saved without scaler=?), and this optimizer scales "
                "the loss: its scale would start over" if scaler_state is None else
                "the state dict holds a loss scaler's state, and this optimizer has no scaler= to take it"))
        if self.scaler is not None:
            self.scaler.validate_state_dict(scaler_state)
        groups = self.param_groups
        lr_tensors = [group["lr"] for group in groups]
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != "scaler"})
        if self.scaler is not None:
            self.scaler.load_state_dict(scaler_state)
        for group, loaded, lr in zip(groups, self.optimizer.param_groups, lr_tensors, strict=True):
            loaded_lr = loaded["lr"]
            group.update({k: v for k, v in loaded.items() if k not in ("params", "lr")})
            lr.fill_(float(loaded_lr))
            group["lr"] = lr
        self.optimizer.param_groups = groups
        self.state = self.optimizer.state
        _make_capturable(self.optimizer)
        self._runner.invalidate()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else loss * self.scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grads in place once they exist (``set_to_none`` is ignored: they are static)."""
        for p in self._params:
            if p.grad is not None:
                p.grad.zero_()

    def _bind_grads(self) -> None:
        if self._grads is None:
            if any(p.grad is None for p in self._params):
                raise RuntimeError("graphstep.wrap: every param needs a grad before the first step "
                                   "(run backward first; leave params that get no grad out of the optimizer)")
            self._grads = [p.grad for p in self._params]
            return
        for i, p in enumerate(self._params):
            static = self._grads[i]
            if p.grad is None:
                static.zero_()  # the user set it to None and no grad arrived since: a zero grad
                p.grad = static
            elif p.grad is not static:
                static.copy_(p.grad)
                p.grad = static

    def _static_inputs(self) -> dict:
        named = {f"param[{i}]": p for i, p in enumerate(self._params)}
        named.update({f"grad[{i}]": g for i, g in enumerate(self._grads or [])})
        for i, p in enumerate(self._params):
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    named[f"state[{i}].{key}"] = value
        for g, group in enumerate(self.optimizer.param_groups):
            named[f"lr[{g}]"] = group["lr"]
        return named

    def _baked_values(self) -> tuple:
        return tuple((g, key, group.get(key)) for g, group in enumerate(self.optimizer.param_groups)
                     for key in _BAKED_KEYS)

    def _torch_step(self) -> None:
        with warnings.catch_warnings():
            # torch warns once when a capturable step runs uncaptured; the warm-up steps do so by design.
            warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
            self.optimizer.step()

    def _device_step(self) -> None:
        if self.scaler is None:
            self._torch_step()
            return
        if self._scale_stages is None:
            # The engine's own stages over the wrapped optimizer's grads: the non-finite check (one norm
            # pass) before torch's fused step, the loss-scale update and the result flags after it.
            self._scale_stages = (
                norm_stage.build_over([norm_stage.ForeachSumOfSquares(self._grads)], self.tensors, Collectives()),
                loss_scale_stage.build_over(self.scaler, self.tensors))
        check, finish = self._scale_stages
        check.apply()
        # torch's AMP protocol for fused optimizers: grads divided by grad_scale, step skipped on found_inf.
        self.optimizer.grad_scale = self.scaler.scale
        self.optimizer.found_inf = self.tensors.found_inf
        try:
            self._torch_step()
        finally:
            del self.optimizer.grad_scale, self.optimizer.found_inf
        finish.apply()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        self._requires_grad.check()
        self._bind_grads()
        self._runner.run()
        return self.update_successful


def wrap(optimizer: torch.optim.Optimizer, *, warmup: int = 1, scaler=None, capture: str = "graph",
         capture_invalidation: str = "recapture") -> CapturedOptimizer:
    """Capture ``optimizer.step()`` (Adam, AdamW or SGD with ``fused=True``) after ``warmup`` eager steps.

    Settings that would freeze under capture are refused with a message naming them. ``scaler``: a
    graphstep loss scaler (``graphstep.step.scaler``), for fp16 loops; ``scale_loss`` multiplies by it.
    ``capture``: "graph" (CUDA graph on CUDA, the CPU replay backend elsewhere) or "eager".
    """
    reasons = _refusals(optimizer)
    if reasons:
        raise ValueError("graphstep.wrap cannot capture this optimizer without freezing something:\n  "
                         + "\n  ".join(reasons))
    if warmup < 1:
        raise ValueError(f"graphstep.wrap: warmup={warmup}: at least 1, torch creates the state on the first step")
    if capture not in ("graph", "eager"):
        raise ValueError(f"graphstep.wrap: capture={capture!r}: must be 'graph' or 'eager'")
    return CapturedOptimizer(optimizer, warmup=warmup, scaler=scaler, capture_mode=capture,
                             invalidation=capture_invalidation)
