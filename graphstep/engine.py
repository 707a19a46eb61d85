"""The optimizer object users hold: ``get_optimizer`` builds it, ``step`` runs the chain of stages.

It is a ``torch.optim.Optimizer`` as far as torch's LR schedulers, ``param_groups`` and ``state_dict``
are concerned. Everything else about it is static: the layout is planned once, the buffers are allocated
once, and ``step`` only refreshes the hyperparameter tensors (host side) and applies the stage chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from capture.profile import Ranges

from . import overlap
from . import overrides as overrides_mod
from . import state_dict as state_dict_mod
from .buffers import StaticBuffers, allocate
from .config import OptimizerConfig
from .debug import StepReport, run_debug_step
from .distributed import Collectives, derive_group
from .hyperparams import HyperParams
from .kernels import get_kernels
from .layout import Layout, ParamSpec, plan_layout
from .runner import StepRunner, baked_values
from .scaler import scaler_from_config
from .stages import Stage, StepTensors, chain, clip, gather, reduce, scale, unscale, update, zeros

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class StepResult:
    """What a step reports, as device tensors (no host sync). They are static and overwritten by the
    next step: clone what you keep, read ``.item()`` only where you want the sync."""

    update_successful: torch.Tensor  # bool
    grad_norm: torch.Tensor  # fp32, unscaled global L2 norm before clipping
    num_zeros: Optional[torch.Tensor]  # int64 count of zero grads, or None
    loss_scale: torch.Tensor  # fp32, the scale the next backward uses


@dataclass
class StepContext:
    """What the stage factories build from: one object, so a stage's inputs are explicit."""

    config: OptimizerConfig
    layout: Layout
    buffers: StaticBuffers
    hyper: HyperParams
    kernels: object
    tensors: StepTensors
    scaler: object
    comm: Collectives
    rank: int


def get_optimizer(config: OptimizerConfig, model_chunks, config_overrides=None, process_group=None,
                  model_parallel_group=None) -> "GraphstepOptimizer":
    """Build the engine over ``model_chunks`` (an nn.Module or a list of them).

    ``config_overrides``: None applies the standard overrides (no weight decay on biases and 1-D params,
    ``decoupled_lr`` for embedding/output params); ``{}`` applies none. ``process_group``: the
    data-parallel group (default WORLD when torch.distributed is initialised and the distributed optimizer
    is on). ``model_parallel_group``: summed over as well for the grad norm and the non-finite check.
    """
    return GraphstepOptimizer(config, model_chunks, config_overrides, process_group, model_parallel_group)


def _named_trainable_params(model_chunks) -> list[tuple[str, torch.nn.Parameter]]:
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TypeError("get_optimizer: model_chunks must be an nn.Module or a non-empty list of them")
    named, seen = [], set()
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            named.append((name if len(chunks) == 1 else f"{c}.{name}", p))
    if not named:
        raise ValueError("get_optimizer: the model has no trainable parameters")
    return named


def _defaults(config: OptimizerConfig) -> dict:
    # torch's OneCycleLR cycles 'betas' or 'momentum' only when the optimizer's defaults have them.
    if config.optimizer == "adam":
        return {"lr": config.lr, "weight_decay": config.weight_decay, "eps": config.adam_eps,
                "betas": (config.adam_beta1, config.adam_beta2)}
    return {"lr": config.lr, "weight_decay": config.weight_decay, "momentum": config.sgd_momentum,
            "nesterov": config.sgd_nesterov}


def _data_parallel(config: OptimizerConfig, process_group) -> tuple[Optional[dist.ProcessGroup], int, int]:
    """(group, rank, size) the state is sharded over; size 1 without the distributed optimizer.

    With several ranks the group is graphstep's own copy of ``process_group`` (same ranks and backend)
    created with ``timeout=distributed_timeout_s``, so every collective of the step, eager or replayed,
    fails within that timeout when a peer dies or stops answering (see distributed.py). Creating it is
    collective over the group's members: all of them build the optimizer together.
    """
    if not config.use_distributed_optimizer:
        if process_group is not None and dist.get_world_size(process_group) > 1:
            raise ValueError("process_group has several ranks but use_distributed_optimizer=False: graphstep "
                             "reduces grads only with the distributed optimizer; set it True")
        return None, 0, 1
    if process_group is None:
        if not dist.is_initialized():
            return None, 0, 1
        process_group = dist.group.WORLD
    rank, size = dist.get_rank(process_group), dist.get_world_size(process_group)
    if rank < 0:
        raise ValueError("get_optimizer: this process is not a member of process_group; pass the "
                         "data-parallel group this rank belongs to")
    if size == 1:
        return None, 0, 1
    return derive_group(process_group, config.distributed_timeout_s), rank, size


class GraphstepOptimizer(torch.optim.Optimizer):
    def __init__(self, config: OptimizerConfig, model_chunks, config_overrides=None, process_group=None,
                 model_parallel_group=None):
        if not isinstance(config, OptimizerConfig):
            raise TypeError(f"get_optimizer: config must be an OptimizerConfig, got {type(config).__name__}")
        self.config = config
        named = _named_trainable_params(model_chunks)
        groups = overrides_mod.build_param_groups(named, config, config_overrides)  # validates the overrides
        self._building = True
        super().__init__(groups, _defaults(config))
        self._building = False

        params = [p for _, p in named]
        device = params[0].device
        for name, p in named:
            if p.device != device:
                raise ValueError(f"param '{name}' is on {p.device}, others on {device}: put the model on one "
                                 "device before get_optimizer")
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        specs = [self._param_spec(name, p, group_of[id(p)]) for name, p in named]

        dp_group, rank, dp_size = _data_parallel(config, process_group)
        self.layout = plan_layout(specs, dp_size, config.bucket_size)
        self.rank = rank
        self.device = device
        self.buffers = allocate(self.layout, params, rank=rank, device=device,
                                main_dtype=config.main_params_dtype, state_names=self._state_names())
        self.hyper = HyperParams(len(self.param_groups), device)
        self.scaler = scaler_from_config(config, device)
        scaled = self.scaler is not None
        self.tensors = StepTensors.allocate(device, self.scaler.scale if scaled else None,
                                            self.scaler.inv_scale if scaled else None, config.log_num_zeros_in_grad)
        self.clip_grad = config.clip_grad
        """Clip threshold, refreshed into a device tensor before each step: may change between steps."""
        self.grad_norm_skip_threshold = config.grad_norm_skip_threshold
        """Norm above which a step is skipped, refreshed like ``clip_grad``."""
        self.comm = Collectives(dp_group, dp_size, model_parallel_group, timeout_s=config.distributed_timeout_s)
        self._ctx = StepContext(config, self.layout, self.buffers, self.hyper, get_kernels(config.kernel),
                                self.tensors, self.scaler, self.comm, rank)
        self.stages = self._build_stages()
        self._step_fn = chain(self.stages)
        self.ranges = Ranges()
        """Profiler ranges: set ``opt.ranges.enabled = True`` for an NVTX / torch.profiler range per stage
        of eager steps and one around each replay; off, the step runs without them."""
        self._ranged_step_fn = chain(self.stages, ranges=self.ranges)
        self._overlap = overlap.install(self._ctx, self.config, model_chunks)
        self._runner = StepRunner(
            step_fn=self._step_fn, mode=config.capture, device=device, warmup_steps=config.capture_warmup_steps,
            invalidation=config.capture_invalidation, static_inputs=self._static_inputs,
            eager_step_fn=lambda: (self._ranged_step_fn if self.ranges.enabled else self._step_fn)(),
            baked_values=lambda: baked_values(self.hyper, self._ctx.kernels.LIVE_FIELDS,
                                              update.used_fields(config.optimizer))
            + update.baked_choices(self._ctx))
        publish = [update.build_copy_back(self._ctx)]
        if self.layout.dp_size > 1:
            publish.append(gather.build(self._ctx, deferrable=False))
        self._publish_fn = chain(publish)
        self.result = StepResult(self.tensors.update_successful, self.tensors.grad_norm, self.tensors.num_zeros,
                                 self.tensors.loss_scale)

    # ---- build -----------------------------------------------------------------------------------------
    def _param_spec(self, name: str, p: torch.nn.Parameter, group: int) -> ParamSpec:
        dtype = self.config.model_dtype or p.dtype
        if not dtype.is_floating_point:
            raise ValueError(f"param '{name}' has dtype {dtype}: only floating-point params can be trained")
        grad_dtype = self.config.main_grads_dtype if dtype in _HALF else dtype
        return ParamSpec(name, tuple(p.shape), dtype, grad_dtype, group)

    def _state_names(self) -> tuple[str, ...]:
        if self.config.optimizer == "adam":
            return ("exp_avg", "exp_avg_sq")
        return ("momentum_buffer",) if self.config.sgd_momentum > 0 else ()

    def _build_stages(self) -> list[Stage]:
        ctx = self._ctx
        sharded = self.layout.dp_size > 1
        stages = [reduce.build(ctx)] if sharded else []
        stages.append(unscale.build(ctx))
        if self.config.log_num_zeros_in_grad:
            stages.append(zeros.build(ctx))
        stages += [clip.build(ctx), update.build(ctx), update.build_copy_back(ctx)]
        if sharded:
            stages.append(gather.build(ctx))
        stages.append(scale.build(ctx))
        return stages

    def add_param_group(self, param_group: dict) -> None:
        if not self._building:
            raise RuntimeError("graphstep lays params out once, at get_optimizer: build a new optimizer over "
                               "the model to add params")
        super().add_param_group(param_group)

    # ---- the training-loop API -------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale, on device; the loss itself without a scaler."""
        return loss if self.scaler is None else loss * self.tensors.loss_scale

    @property
    def loss_scale(self) -> torch.Tensor:
        return self.tensors.loss_scale

    def _prepare(self) -> None:
        """Host-side work before the device step: keep the static bindings, refresh the hyperparameters."""
        replaced = self.buffers.restore_replaced_buffers()
        if not self.buffers.bindings_intact():
            replaced += self.buffers.readopt_params()  # also rebinds grads a user set to None
        if replaced:
            self._runner.on_replaced(replaced)
        self.hyper.refresh(self.param_groups, {"clip_grad": self.clip_grad,
                                               "grad_norm_skip_threshold": self.grad_norm_skip_threshold})

    @torch.no_grad()
    def step(self, closure=None) -> StepResult:
        """Apply one optimizer step; returns the (static, device-side) StepResult. No host sync."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        with self.ranges("graphstep.step"):
            self._prepare()
            with self.comm.named_errors():  # a collective failing in a replay is named like an eager one
                self._runner.run()
        return self.result

    # ---- capture -------------------------------------------------------------------------------------
    @property
    def captured(self) -> bool:
        """Whether the step is captured now (later steps replay it)."""
        return self._runner.captured

    @property
    def capture_backend(self) -> str:
        """"cuda", "replay" or "eager": what runs the step."""
        return self._runner.backend

    def recapture(self) -> None:
        """Adopt replaced params and buffers back into the static buffers; capture anew at the next step."""
        self.buffers.restore_replaced_buffers()
        self.buffers.readopt_params()
        self._runner.invalidate()

    def _static_inputs(self) -> dict:
        named = self.buffers.addresses()
        named["hyperparameters"] = self.hyper.values
        for field in ("step", "found_inf", "grad_norm", "clip_coef", "grad_scale", "update_successful",
                      "loss_scale", "inv_loss_scale"):
            named[field] = getattr(self.tensors, field)
        return named

    def debug_step(self, closure=None) -> "StepReport":
        """One step run stage by stage, eagerly, with host-read per-stage stats and NaN provenance.

        Syncs with the device after every stage: for debugging, not for training speed. It applies a
        real step (the same stage functions a capture records), so it can stand in for ``step()``.
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        with torch.no_grad():
            self._prepare()
            return run_debug_step(self)

    def finish_param_gather(self) -> None:
        """Wait for all-gathers deferred by ``overlap_param_gather``: call before reading params outside a
        forward (a forward waits for them itself)."""
        self._overlap.finish()

    def no_sync(self):
        """Context manager for grad accumulation with ``overlap_grad_reduce``: backward inside it only
        accumulates; the reduce-scatters start in the last micro-batch's backward, outside it."""
        return self._overlap.no_sync()

    @torch.no_grad()
    def publish_params(self) -> None:
        """Copy the main params into the model params (and all-gather them across data-parallel ranks):
        what a checkpoint load runs after copying into the main params. Collective with several ranks."""
        self._publish_fn()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every grad in place (``set_to_none`` is ignored: the grad buffers are static)."""
        self.buffers.zero_grad()

    # ---- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's flat buffers, exact, for ``torch.save`` flows at the same layout (graphstep.state_dict)."""
        return state_dict_mod.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load by copying into the existing buffers (addresses never change), then refresh model params."""
        state_dict_mod.load_state_dict(self, state_dict)

    def sharded_state_dict(self) -> dict:
        """The reshardable per-param checkpoint format, this rank's slices as views of the live buffers
        (like torch's state dicts; ``gs.checkpoint.sharded_state_dict(opt, snapshot=True)`` copies)."""
        from .checkpoint import sharded
        return sharded.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """Load the reshardable format from any data-parallel size or layout: validated, copied in place."""
        from .checkpoint import sharded
        sharded.load_sharded_state_dict(self, state_dict)
