"""graphstep.wrap: capture the step of a plain torch.optim optimizer (Adam, AdamW, SGD).

What a capture would freeze, and what ``wrap`` does: ``lr`` becomes a 0-d device tensor that torch's schedulers
``fill_`` (fp64 on the CPU, so the result stays bitwise equal); only fused (or capturable) Adam keeps its step
count on device, others are refused; other float hyperparameters are guarded, and a change recaptures; new grad
tensors from ``zero_grad()`` are copied into the captured ones; the first step runs eagerly, since torch creates
the state then. Fused groups get ``capturable=True``, which the fused kernel ignores but torch's capture check
demands. It stays a torch optimizer where torch's contract says what one does (``add_param_group``,
``load_state_dict``, step hooks run once outside the capture, deepcopy and pickle; refusals in ``wrap_checks``).
With a graphstep loss scaler (``scaler=``) the grads are checked on device and a skipped step changes nothing.
"""

from __future__ import annotations

import operator
import warnings
from typing import Optional

import torch

from .checkpoint.optimizer_hooks import runs_load_state_dict_hooks, runs_state_dict_hooks
from .config.listing import listed
from .hooks.requires_grad_watch import RequiresGradWatch
from .parallel.collectives import Collectives
from .run.memory import memory_stats_by_kind
from .run.runner import StepRunner
from .state.hyperparams import scalar_dtype
from .step.stages import StepTensors
from .step.stages import loss_scale as loss_scale_stage
from .step.stages import norm as norm_stage
from .wrap_checks import (group_refusals, is_dense, make_capturable, optimizer_refusals, share_step_hooks,
                          state_dict_in_this_implementation, unhooked_step)

# Settings each kernel takes as Python values: captured once, guarded before every replay.
_BAKED_KEYS = ("betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "maximize", "amsgrad")


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
        self._wrap_options = {"warmup": warmup, "capture": capture_mode, "capture_invalidation": invalidation}
        # One set of step hooks for both: registered on either, they run once, around this optimizer's step
        # (the wrapped one's step is called without its hook wrapper, ``unhooked_step``).
        share_step_hooks(self, optimizer)
        self._torch_step_fn = unhooked_step(optimizer)
        devices = {p.device for group in optimizer.param_groups for p in group["params"]}
        if len(devices) != 1:
            raise ValueError(f"graphstep.wrap: params on several devices {sorted(map(str, devices))}")
        self.device = devices.pop()
        self._params: list[torch.Tensor] = []
        self._grads: list[Optional[torch.Tensor]] = []  # the static grads, None until a param's first step
        self._adopt_groups()
        self.tensors = StepTensors.allocate(self.device, None if scaler is None else scaler.scale,
                                            None if scaler is None else scaler.inv_scale)
        self.found_inf = self.tensors.found_inf
        self.update_successful = self.tensors.update_successful
        self._runner = StepRunner(step_fn=self._device_step, mode=capture_mode, device=self.device,
                                  warmup_steps=warmup, invalidation=invalidation,
                                  static_inputs=self._static_inputs, baked_values=self._baked_values)

    def _adopt_groups(self) -> None:
        """Derive what the step holds from ``param_groups``: at wrap, and after a group was added or loaded."""
        make_capturable(self.optimizer)
        for group in self.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=scalar_dtype(self.device), device=self.device)
        self._lr_tensors = [group["lr"] for group in self.param_groups]  # what the captured step reads
        named = [(f"param_groups[{g}]['params'][{i}]", p)
                 for g, group in enumerate(self.param_groups) for i, p in enumerate(group["params"])]
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._grads += [None] * (len(self._params) - len(self._grads))  # groups are only ever appended
        # A grad set to None becomes a zero grad here (the captured step reads static grads), so a param
        # frozen after wrapping would go on moving under momentum and weight decay: refused by name.
        self._requires_grad = RequiresGradWatch([], named)
        self._scale_stages = None  # (norm, loss_scale) over the static grads, built at the next step

    @property
    def captured(self) -> bool:
        """Whether the step is captured now (later steps replay it)."""
        return self._runner.captured

    @property
    def capture_backend(self) -> str:
        """What runs the step: the capture backend's name (a CUDA graph, the CPU replay backend, or eager;
        see ``capture.devices.backend_for``), as ``GraphstepOptimizer.capture_backend``."""
        return self._runner.backend

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Bytes the wrapped optimizer's step holds, by kind (its params, the static grads, each state by its
        name, the scalars) with totals, as ``GraphstepOptimizer.memory_stats`` (graphstep.run.memory)."""
        state: dict[str, list] = {}
        for p in self._params:
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    state.setdefault(key, []).append(value)
        scalars = [*self._lr_tensors, *self.tensors.named().values()]
        if self.scaler is not None:
            scalars += [t for t in vars(self.scaler).values() if isinstance(t, torch.Tensor)]
        kinds = {"params": self._params, "grads": [g for g in self._grads if g is not None], **state,
                 "scalars": scalars}
        return memory_stats_by_kind(kinds, self._runner.pool_bytes())

    @property
    def recaptures(self) -> int:
        """How many times the captured step was captured again after going stale."""
        return self._runner.recaptures

    def close(self) -> None:
        """Release the captured step (graph and memory pool); later steps run eagerly."""
        self._runner.close()

    def __reduce_ex__(self, protocol):
        # torch's Optimizer pickles (and so deep-copies) only defaults, state and param_groups, which leaves
        # this object without its step. A copy wraps a copy of the wrapped optimizer (its params, state and lr
        # tensors) and of the scaler anew; torch's copies drop the step hooks, and so does this one.
        return (_rewrapped, (self.optimizer, self.scaler, self._wrap_options))

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group`` (its defaults and checks), then the new group is laid out as the others:
        refused here if its step could not be captured, its lr made a device tensor, its params zeroed by
        ``zero_grad``; the next step runs eagerly (torch creates the new params' state) and the one after is
        captured anew. Each new param needs a grad at its first step, as every param does at the first."""
        if "optimizer" not in self.__dict__:
            super().add_param_group(param_group)  # torch.optim.Optimizer.__init__ adopting the wrapped groups
            return
        self.optimizer.add_param_group(param_group)  # appends to the list both share
        g = len(self.param_groups) - 1
        added = self.param_groups[g]
        reasons = group_refusals(self.optimizer, g, added)
        moved = sorted({str(p.device) for p in added["params"] if p.device != self.device})
        if moved:
            reasons.append(f"group {g}: params on {', '.join(moved)}, the others on {self.device}")
        if reasons:
            self.param_groups.pop()
            raise ValueError("graphstep.wrap: add_param_group: the step could not be captured with this group:\n  "
                             + "\n  ".join(reasons))
        self._adopt_groups()
        self._runner.invalidate()

    @runs_state_dict_hooks
    def state_dict(self) -> dict:
        """torch's state dict of the wrapped optimizer, each lr as a float (the value now, as torch's optimizers
        save it, not the live tensor a scheduler goes on filling), and under ``"scaler"`` the loss scaler's state
        (its scale and trackers: a resume without them would start the loss scale over)."""
        saved = self.optimizer.state_dict()
        for group in saved["param_groups"]:  # torch's own dicts, made for this state dict
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = float(group["lr"])
        if self.scaler is not None:
            saved["scaler"] = self.scaler.state_dict()
        return saved

    @runs_load_state_dict_hooks
    def load_state_dict(self, state_dict: dict) -> None:
        """Loads through torch, then puts this optimizer's own param-group dicts and lr tensors back; the loss
        scaler's state is validated before anything is loaded and loaded after torch's part.

        The saved groups give the hyperparameters; how the update runs (``fused``, ``capturable``, ``foreach``,
        ``differentiable``) stays this optimizer's, so a state dict from a non-fused run, or from a torch
        that saved no such keys, loads into a step that can still be captured; the groups as they will be are
        checked as ``wrap`` checks them before anything is loaded.

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
        loading = state_dict_in_this_implementation({k: v for k, v in state_dict.items() if k != "scaler"}, groups)
        if len(loading.get("param_groups", ())) == len(groups):
            reasons = [reason for g, (saved, group) in enumerate(zip(loading["param_groups"], groups))
                       for reason in group_refusals(self.optimizer, g, {**saved, "params": group["params"]})]
            if reasons:
                raise ValueError("graphstep.wrap: load_state_dict: the step could not be captured with the "
                                 "loaded groups:\n  " + "\n  ".join(reasons))
        self.optimizer.load_state_dict(loading)
        if self.scaler is not None:
            self.scaler.load_state_dict(scaler_state)
        for group, loaded, lr in zip(groups, self.optimizer.param_groups, self._lr_tensors, strict=True):
            loaded_lr = loaded["lr"]
            group.update({k: v for k, v in loaded.items() if k not in ("params", "lr")})
            lr.fill_(float(loaded_lr))
            group["lr"] = lr
        self.optimizer.param_groups = groups
        self.state = self.optimizer.state
        self._adopt_groups()
        self._runner.invalidate()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else loss * self.scaler.scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grads in place once they exist (``set_to_none`` is ignored: they are static)."""
        for p in self._params:
            if p.grad is not None:
                p.grad.zero_()

    def _check_groups_unchanged(self) -> None:
        held = [p for group in self.param_groups for p in group["params"]]
        if len(held) != len(self._params) or not all(map(operator.is_, held, self._params)):
            raise RuntimeError(
                "graphstep.wrap: the params in param_groups changed since they were wrapped (a param put into or "
                "taken out of a group's list, or a group appended directly or through the wrapped optimizer): the "
                "captured step holds the old ones. Add params with this optimizer's add_param_group({'params': "
                "[...]}); to drop params, wrap a new optimizer")

    def _take_assigned_lrs(self) -> None:
        """An lr assigned into a group (``group["lr"] = 0.01``, as torch lets a loop set it) goes into the lr
        tensor the captured step reads, which is put back: the next step uses it, as torch's would."""
        for group, lr in zip(self.param_groups, self._lr_tensors):
            value = group["lr"]
            if value is not lr:
                if isinstance(value, torch.Tensor):
                    lr.copy_(value)  # on device: no sync
                else:
                    lr.fill_(float(value))
                group["lr"] = lr

    def _bind_grads(self) -> None:
        """Point every param at its static grad, holding this step's values (zero where the grad is None)."""
        missing = []
        for i, p in enumerate(self._params):
            static, grad = self._grads[i], p.grad
            if static is None:  # this param's first step: its grad becomes the static one
                if grad is None:
                    missing.append(self._names[i])
                    continue
                if grad.stride() != p.stride() and is_dense(p):
                    # torch's fused kernels walk param, grad and state in memory order: a grad laid out apart
                    # from its param (a transposed param given a row-major grad) would pair wrong elements.
                    static = torch.empty_like(p, requires_grad=False)
                    static.copy_(grad)
                    p.grad = static
                else:
                    static = grad
                self._grads[i] = static
            elif grad is None:
                static.zero_()  # the user set it to None and no grad arrived since: a zero grad
                p.grad = static
            elif grad is not static:
                static.copy_(grad)
                p.grad = static
        if missing:
            raise RuntimeError(f"graphstep.wrap: no grad at the first step of {listed(missing)}: every param needs one "
                               "there (run backward first; leave params that get no grad out of the optimizer)")

    def _static_inputs(self) -> dict:
        named = {f"param[{i}]": p for i, p in enumerate(self._params)}
        named.update({f"grad[{i}]": g for i, g in enumerate(self._grads) if g is not None})
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
            self._torch_step_fn(self.optimizer)

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
        """One step: the closure (if any) runs first, eagerly, with grad enabled; returns its loss, as torch's
        optimizers do (None without a closure). Whether the step applied is ``update_successful``, a device
        flag (always true without a ``scaler``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups_unchanged()
        self._take_assigned_lrs()
        self._requires_grad.check()
        self._bind_grads()
        self._runner.run()
        return loss


def _rewrapped(optimizer: torch.optim.Optimizer, scaler, options: dict) -> CapturedOptimizer:
    """What a copied or unpickled ``CapturedOptimizer`` is built by (``__reduce_ex__``)."""
    return wrap(optimizer, scaler=scaler, **options)


def wrap(optimizer: torch.optim.Optimizer, *, warmup: int = 1, scaler=None, capture: str = "graph",
         capture_invalidation: str = "recapture") -> CapturedOptimizer:
    """Capture ``optimizer.step()`` (Adam, AdamW or SGD with ``fused=True``) after ``warmup`` eager steps.

    Settings that would freeze under capture are refused with a message naming them, and so are params torch's
    fused kernels would step wrongly (not dense in memory). ``scaler``: a graphstep loss scaler
    (``graphstep.step.scaler``), for fp16 loops; ``scale_loss`` multiplies by it. ``capture``: "graph" (CUDA
    graph on CUDA, the CPU replay backend elsewhere) or "eager".
    """
    reasons = optimizer_refusals(optimizer)
    if reasons:
        raise ValueError("graphstep.wrap cannot capture this optimizer without freezing something or stepping it "
                         "wrongly:\n  " + "\n  ".join(reasons))
    if warmup < 1:
        raise ValueError(f"graphstep.wrap: warmup={warmup}: at least 1, torch creates the state on the first step")
    if capture not in ("graph", "eager"):
        raise ValueError(f"graphstep.wrap: capture={capture!r}: must be 'graph' or 'eager'")
    return CapturedOptimizer(optimizer, warmup=warmup, scaler=scaler, capture_mode=capture,
                             invalidation=capture_invalidation)
