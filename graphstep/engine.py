"""The optimizer object users hold: ``get_optimizer`` (graphstep/factory.py) builds it, ``step`` runs the chain of
stages.

It is a ``torch.optim.Optimizer`` as far as torch's LR schedulers, ``param_groups`` and ``state_dict``
are concerned. Everything else about it is static: the layout is planned once, the buffers are allocated
once, and ``step`` only refreshes the hyperparameter tensors (host side) and applies the stage chain.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from capture.devices import backend_for, device_scope
from capture.profile import Ranges

from . import families as families_mod
from . import offload
from .plan import model_parallel
from .plan.experts import is_expert_param
from .plan.layout import plan_layout
from .plan.model_params import (as_chunks, named_model_params, named_trainable_params, param_spec,
                                 warn_dtype_conversion)
from .plan.routing import build_family_param_groups
from .checkpoint import state_dict as state_dict_mod
from .checkpoint.optimizer_hooks import runs_load_state_dict_hooks, runs_state_dict_hooks
from .checkpoint.torch_api import STATE_RESET, ParamState
from .config import OptimizerConfig
from .families import families_of, state_names
from .fp8 import engine_support as fp8_support
from .hooks import ddp, grad_overlap, model_state_dict
from .hooks.fold import Fold
from .hooks.grads_seen import GradsSeen
from .hooks.micro_batches import NoSync
from .hooks.param_hooks import GradHooks
from .hooks.replaced_params import ReplacedParams
from .hooks.requires_grad_watch import RequiresGradWatch
from .kernels import choose_kernels
from .parallel import teardown
from .parallel.agreement import agreement_for
from .parallel.collectives import Collectives, data_parallel_group
from .run.debug import StepReport, run_debug_step, trace_closure
from .run.memory import memory_stats
from .run.runner import StepRunner
from .state.allocation import allocate
from .state.buffers import StaticBuffers
from .state.group_watch import GroupWatch
from .state.param_writes import ParamWrites
from .state.hyperparams import HyperParams
from .state.precision import main_compute_dtype, main_storage, storage_by_state
from .step import domains as domains_mod
from .step import folded_sums, compiled_scalar_math
from .step.scaler import scaler_from_config
from .step.chain import default_chain, publish_chain
from .step.stages import StepTensors, baked_values, chain
from .step.stages.context import StepContext
from .step.torch_amp import TorchGradScaler


@dataclass(frozen=True)
class StepResult:
    """What a step reports, as device tensors (no host sync). They are static and overwritten by the
    next step: clone what you keep, read ``.item()`` only where you want the sync."""

    update_successful: torch.Tensor  # bool
    grad_norm: torch.Tensor  # fp32, unscaled global L2 norm before clipping
    num_zeros: Optional[torch.Tensor]  # int64 count of zero grads, or None
    loss_scale: torch.Tensor  # fp32, the scale the next backward uses
    skipped_steps: torch.Tensor  # int64, the steps skipped (non-finite grads, skip threshold) since the build


def _static_inputs(domains: tuple[domains_mod.Domain, ...], hyper: HyperParams, tensors: StepTensors):
    """What a capture guards before each replay: every domain's static buffers (named by its role), the
    hyperparameters, the scalars."""
    fixed = {"hyperparameters": hyper.values, **tensors.named()}

    def named() -> dict:
        return {**{k: v for domain in domains for k, v in domain.addresses().items()}, **fixed}

    return named


def _agreement(config: OptimizerConfig, device, comm: Collectives):
    """How the ranks agree on recapturing (``RankAgreement.any``), or None: one process, or no capture."""
    if backend_for(device, config.capture)[0] == "eager":
        return None
    agreement = agreement_for(comm.dp_group, comm.mp_group, config.distributed_timeout_s, comm.host_group)
    return None if agreement is None else agreement.any


class GraphstepOptimizer(torch.optim.Optimizer):
    _step_supports_amp_scaling = True
    """torch's GradScaler hands its scale and inf flag to ``step`` instead of unscaling
    (graphstep/step/torch_amp.py)."""

    def __init__(self, config: OptimizerConfig, model_chunks, config_overrides=None, process_group=None,
                 model_parallel_group=None, expert_data_parallel_group=None, tensor_parallel_group=None,
                 expert_tensor_parallel_group=None):
        if not isinstance(config, OptimizerConfig):
            raise TypeError(f"get_optimizer: config must be an OptimizerConfig, got {type(config).__name__}")
        self.config = config
        model_named = named_trainable_params(model_chunks, dtensors=self.local_shards is not None)
        chunks = as_chunks(model_chunks)
        ddp.check_at_build(chunks, config.use_distributed_optimizer)
        # Validates the overrides; routes each param to its optimizer family (the groups' "optimizer" key).
        groups = build_family_param_groups(model_named, config, config_overrides, model_chunks=model_chunks)
        self._building = True
        super().__init__(groups, families_mod.torch_defaults(config))  # what schedulers see
        self._building = False
        group_of = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        group_index = [group_of[id(p)] for _, p in model_named]
        self._families = families = families_of(self.param_groups, config.optimizer)
        named = self._laid_out(model_named, group_index)  # what the flat buffers hold, in the same order

        params = [p for _, p in named]
        device = params[0].device
        for name, p in named:
            if p.device != device:
                raise ValueError(f"param '{name}' is on {p.device}, others on {device}: put the model on one "
                                 "device before get_optimizer")
        warn_dtype_conversion(config, named)
        fp8_support.check_against_config(config, named)
        model_parallel_group, norm_counting = model_parallel.resolve(named, model_parallel_group, tensor_parallel_group,
                                                                expert_tensor_parallel_group)
        specs = [param_spec(config, name, p, g, families[g].batch_by_shape, norm_counting.counts(p))
                 for (name, p), g in zip(named, group_index)]

        dp_group, rank, dp_size = data_parallel_group(config, process_group)
        # MoE expert params: an expert domain over the expert data-parallel group (experts.py), or none.
        dense_indices, expert_plans = domains_mod.plan(config, named, expert_data_parallel_group, dp_group, dp_size,
                                                  model_parallel_group, expert_tensor_parallel_group)
        layout = plan_layout([specs[i] for i in dense_indices], dp_size, config.bucket_size)
        self.rank = rank
        self.device = device
        # Hybrid CPU offload: the host part of this rank's shard (None without it), before the device buffers
        # so that those are allocated for the device part only.
        host = offload.prepare_host(config, layout, rank, device, state_names(families, config),
                                    len(self.param_groups), experts=bool(expert_plans))  # offload: dense only
        buffers = allocate(layout, [params[i] for i in dense_indices], rank=rank, device=device,
                           main_dtype=main_compute_dtype(config), state_names=state_names(families, config), host=host,
                           group_states=[family.state_names(config) for family in families],
                           state_storage=storage_by_state(config, state_names(families, config)),
                           main_storage=main_storage(config))
        self.hyper = HyperParams(len(self.param_groups), device)
        self.scaler = scaler_from_config(config, device)
        scaled = self.scaler is not None
        self.tensors = StepTensors.allocate(device, self.scaler.scale if scaled else None,
                                            self.scaler.inv_scale if scaled else None, config.log_num_zeros_in_grad)
        # torch's ``Optimizer.state`` stays a per-param mapping, but graphstep's state lives in the flat
        # buffers (``opt.state_dict()``, ``gs.checkpoint``); each param's entry names the one step count they
        # share. torch.distributed.checkpoint's get/set_state_dict get torch's format through state_dict() /
        # load_state_dict() (graphstep/checkpoint/torch_format.py); an FSDP2 model's optimizer keeps torch's
        # plain mapping and torch's format (graphstep/fsdp2/state_dict.py).
        self.state = self._param_state()
        self._state = self.state  # an opt.state replaced later (to reset it) is refused at the step
        for _, p in model_named:
            self.state[p]["step"] = self.tensors.step
        self._torch_amp = TorchGradScaler(self.tensors, own_scaler=scaled)
        self.clip_grad = config.clip_grad
        """Clip threshold, refreshed into a device tensor before each step: may change between steps."""
        self.grad_norm_skip_threshold = config.grad_norm_skip_threshold
        """Norm above which a step is skipped, refreshed like ``clip_grad``."""
        self.comm = Collectives(dp_group, dp_size, model_parallel_group, timeout_s=config.distributed_timeout_s,
                                tp_group=tensor_parallel_group)
        # Expert params that joined the dense layout keep their own TP group, which Muon cannot gather over here.
        if not expert_plans and not model_parallel.same_ranks(tensor_parallel_group, expert_tensor_parallel_group):
            self.comm.experts_split_elsewhere = frozenset(name for name, p in named if is_expert_param(p))
        # The one build-time exchange with other ranks: all agree on the layout and config before any stage
        # pairs up buffers (and the model-parallel group gets its timeout). No stage factory talks to peers.
        self.comm.setup(layout, config, device)

        kernels, self.kernel_choice = choose_kernels(config, device, families, self.comm, self.hyper.values.dtype,
                                                     numel=sum(buffer.shard_numel for buffer in layout.buffers))
        """Which update kernel runs (``kernel="auto"`` resolved), why, and the probe's compile seconds."""
        if self.kernel_choice.name == "compiled" and config.capture_warmup_steps < 1 \
                and backend_for(device, config.capture)[0] != "eager":
            # The config refuses capture="graph" so; "auto" captures where the device has CUDA graphs.
            raise ValueError(f"graphstep: kernel='compiled' compiles on its first step, which must run before the "
                             f"step is captured (capture={config.capture!r} captures on {device}): use "
                             "capture_warmup_steps >= 1")
        ctx = StepContext(config, layout, buffers, self.hyper, kernels, families,
                          self.tensors, self.scaler, self.comm, rank, torch_amp=self._torch_amp,
                          compile_scalars=compiled_scalar_math.wanted(self.kernel_choice.name, device),
                          folded=folded_sums.plan(config, layout, buffers, hooked=True))
        dense = domains_mod.Domain(domains_mod.DENSE, layout, buffers, self.comm, ctx)
        self.domains = (dense, *[domains_mod.build_expert_domain(dense, plan, specs, params, device=device,
                                                           state_names=state_names(families, config))
                                 for plan in expert_plans])
        """The sharding domains (graphstep/step/domains.py): the dense params', then the expert params' if any."""
        # The one post-accumulate-grad hook per param: the main grads, grads-seen flag, fold and overlap listen
        # to it, in the order param_hooks.STAGES declares (not the order of the statements here).
        self._grad_hooks = GradHooks()
        for domain in self.domains:
            domain.buffers.listen_for_main_grads(self._grad_hooks)
        self._offload = offload.install(ctx, host, model_chunks)  # inert without CPU offload
        self._model_chunks = tuple(weakref.ref(chunk) for chunk in chunks)
        """The model's modules, weakly (the optimizer never keeps a dropped model alive): for debug_step."""
        # The model's state-dict hooks: they outlive the optimizer.
        self._model_state_dict = model_state_dict.install(chunks, self._domain_buffers())
        self.stages = self._offload.adjust_chain(default_chain(self.domains))
        # host_stages: run after the device step, never captured; host_tensors: {kind: host buffers}.
        self.host_stages, self.host_tensors = self._offload.host_stages, self._offload.host_tensors
        self.ranges = Ranges()
        """Profiler ranges: set ``opt.ranges.enabled = True`` for an NVTX / torch.profiler range per stage
        of eager steps and one around each replay; off, the step runs without them."""
        self._runner = StepRunner(
            step_fn=chain(self.stages), eager_step_fn=chain(self.stages, ranges=self.ranges), device=device,
            mode=config.capture, warmup_steps=config.capture_warmup_steps, invalidation=config.capture_invalidation,
            static_inputs=_static_inputs(self.domains, self.hyper, self.tensors),
            baked_values=baked_values(self.stages),
            agree=_agreement(config, device, self.comm))
        step_groups = [g for d in self.domains for g in (d.comm.dp_group, d.comm.mp_group, d.comm.tp_group)
                       if g is not None]
        if step_groups and self._runner.may_capture:
            # NCCL cannot destroy a communicator while a CUDA graph holds its collectives: the captured step
            # goes first, whichever way the job is torn down (graphstep/parallel/teardown.py).
            teardown.release_before_teardown(self._runner, step_groups)
        self._no_sync = NoSync()  # opt.no_sync(): read by the overlap and the folded norm's hooks
        self._overlap = grad_overlap.install(self.domains, config, model_chunks, may_capture=self._runner.may_capture,
                                        no_sync=self._no_sync, hooks=self._grad_hooks)
        self._publish = chain(publish_chain(self.domains))
        self._grads_seen = GradsSeen(self._grad_hooks, self._domain_buffers())
        self._replaced_params = ReplacedParams(chunks, named)  # kept through close(): later steps still train
        # The model's params, not FSDP2's stand-ins.
        self._requires_grad = RequiresGradWatch(named_model_params(chunks), model_named)
        self._group_watch = GroupWatch(self.param_groups)
        self._fold = Fold([d.ctx.folded for d in self.domains], buffers, self._no_sync,
                                      self._grad_hooks)  # inert without the fold; its hooks: the dense buffers
        explicit_groups = any(g is not None for g in (process_group, model_parallel_group, expert_data_parallel_group,
                                                      tensor_parallel_group))
        self._ddp = ddp.DdpWatch(chunks, distributed_optimizer=config.use_distributed_optimizer,
                                 explicit_groups=explicit_groups, on_ddp=self._fold.fold_before_step)
        self.result = StepResult(self.tensors.update_successful, self.tensors.grad_norm, self.tensors.num_zeros,
                                 self.tensors.loss_scale, self.tensors.skipped_steps)
        # bf16/fp16 params' writes, through the params or their state-dict aliases
        self._param_writes = tuple(ParamWrites(b, self._model_state_dict) for b in self._domain_buffers())

    # ---- what the subclass for FSDP2 models changes (graphstep/fsdp2/optimizer.py) -------------------------
    local_shards = None
    """An FSDP2 model's optimizer (graphstep/fsdp2/optimizer.py): each DTensor param's local shard, what the flat
    buffers hold (graphstep/fsdp2/shards.py). None for other models, whose DTensor params are refused."""

    def _laid_out(self, named: list, group_index: list[int]) -> list:
        """(name, tensor) per trainable param of ``named`` (each in param group ``group_index[i]``, whose family is
        ``self._families[...]``), in order: what the flat buffers hold. The params themselves."""
        return named

    def _param_state(self) -> dict:
        """The empty ``Optimizer.state`` mapping (graphstep/checkpoint/torch_api.py)."""
        return ParamState(dict)

    def add_param_group(self, param_group: dict) -> None:
        if not self._building:
            raise RuntimeError("graphstep lays params out once, at get_optimizer: build a new optimizer over "
                               "the model to add params")
        super().add_param_group(param_group)

    def __deepcopy__(self, memo) -> None:
        # A copy would hold copies of the model's params, bound to nothing the model trains, and buffers whose
        # addresses a captured step was recorded over: refused, with the ways that work.
        raise TypeError("graphstep: a graphstep optimizer cannot be deep-copied (its buffers are bound to the "
                        "model's params): to fork a run, copy the model, build an optimizer over the copy with "
                        "gs.get_optimizer and load this one's state_dict() into it")

    # ---- the training-loop API -------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale, on device; the loss itself without a scaler."""
        return loss if self.scaler is None else loss * self.tensors.loss_scale

    @property
    def loss_scale(self) -> torch.Tensor:
        return self.tensors.loss_scale

    def _prepare(self) -> None:
        """Host-side work before the device step: keep the static bindings, refresh the hyperparameters."""
        self._offload.finish()  # an overlapped host update of the last step must be done first
        self._replaced_params.check()
        self._requires_grad.check()
        if self.state is not self._state:
            raise TypeError(f"opt.state was replaced. {STATE_RESET}")
        edited = self._group_watch.problem(self.param_groups)
        if edited is not None:
            raise ValueError(f"graphstep: {edited}")
        if self._torch_amp.take(self.__dict__):  # torch's GradScaler: its scale and inf flag, on the device
            self._fold.grads_rewritten()  # scaler.unscale_(opt) rewrote the grads unseen by version counters
        self._grads_seen.check()
        self._fold.note_writes()  # fold_grad_norm: grads written since backward, before the engine writes any
        replaced = []
        for buffers in self._domain_buffers():
            restored = buffers.restore_replaced_buffers()
            if restored:
                self._fold.grads_rewritten()  # copied into the static buffers: the folded sums may be stale
                replaced += restored
            if not buffers.bindings_intact():
                self._fold.forget_unbound_grads()  # fold_grad_norm: before the grads are re-bound
                replaced += buffers.readopt_params()  # also rebinds grads a user set to None (as zeros)
        if replaced:
            self._runner.on_replaced(replaced)
            self._model_state_dict.adopt(self._domain_buffers())  # taken back from a later optimizer, say
        for writes in self._param_writes:
            writes.take()  # bf16/fp16: what a user wrote into the params, into the main params
        self._fold.fold_stale()
        for g, (group, family) in enumerate(zip(self.param_groups, self._families)):
            problem = family.group_problem(group, self.config) if family.group_problem is not None else None
            if problem is not None:
                raise ValueError(f"graphstep: param group {g}: {problem}")
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
            # Under the build device (where devices have a "current" one), so that a capture's side stream and
            # graph land on it; a collective failing in a replay is named like an eager one.
            with device_scope(self.device), self.comm.named_errors():
                self._runner.run()
                self._offload.after_device_step()  # CPU offload: never captured, the host update and H2D
            self._fold.after_step(stacklevel=5)  # past torch's no_grad and optimizer-hook wrappers
        # capture="auto" may have settled on eager at this step: the overlap hooks may run from now on.
        self._overlap.enabled = not self._runner.may_capture
        return self.result

    # ---- capture -------------------------------------------------------------------------------------
    @property
    def captured(self) -> bool:
        """Whether the step is captured now (later steps replay it)."""
        return self._runner.captured

    @property
    def capture_backend(self) -> str:
        """What runs the step: the capture backend's name (a CUDA graph, the CPU replay backend, or eager;
        see ``capture.devices.backend_for``)."""
        return self._runner.backend

    @property
    def recaptures(self) -> int:
        """How many times the captured step was captured again after going stale."""
        return self._runner.recaptures

    def reload_model_params(self) -> None:
        """Copy the model's params into the main params where they differ (Megatron-Core's name). The next step
        does this by itself for every param written in place (``model.load_state_dict``, ``nn.init``, a
        ``clamp_``); call it after a write no version counter sees, through ``p.data``."""
        for writes in self._param_writes:
            writes.take(everything=True)

    def recapture(self) -> None:
        """Adopt replaced params and buffers back into the static buffers; capture anew at the next step."""
        for buffers in self._domain_buffers():
            buffers.restore_replaced_buffers()
            buffers.readopt_params()
        self._model_state_dict.adopt(self._domain_buffers())
        self._runner.invalidate()

    def close(self) -> None:
        """Release the captured step (its graph and memory pool) and the overlap hooks (the fold's and the
        grads-seen flag's too; the fp32 main grads keep accumulating through a param's one hook). Later steps
        run eagerly. Idempotent; the optimizer is also a context manager that closes on exit."""
        self._runner.close()
        self._overlap.remove()
        self._offload.remove()
        self._grads_seen.remove()
        self._fold.remove()
        self._ddp.remove()

    def __enter__(self) -> "GraphstepOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def debug_step(self, closure=None) -> "StepReport":
        """One step run stage by stage, eagerly, with host-read per-stage stats and NaN provenance.

        Syncs with the device after every stage: for debugging, not for training speed. It applies a
        real step (the same stage functions a capture records), so it can stand in for ``step()``.
        """
        # The closure (if any) runs with hooks on every module of the model: they find the module that first
        # made a non-finite value, in forward or backward (graphstep/run/debug.py), and are removed after it.
        trace = trace_closure(self, closure)
        with torch.no_grad():
            self._prepare()
            self._fold.warn_out_of_date()
            report = run_debug_step(self, trace)
            self._fold.after_step(stacklevel=3)
            return report

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Bytes this rank's optimizer holds, by kind, on device and host, with totals (graphstep.run.memory)."""
        scalars = list(self.tensors.named().values()) + [self.hyper.values]
        if self.scaler is not None:
            scalars += [t for t in vars(self.scaler).values() if isinstance(t, torch.Tensor)]
        return memory_stats(self.domains, self.host_tensors, scalars, self._runner.pool_bytes())

    def finish_param_gather(self) -> None:
        """Wait for all-gathers deferred by ``overlap_param_gather``: call before reading params outside a
        forward (a forward waits for them itself)."""
        self._overlap.finish()
        self._offload.finish()

    @property
    def overlap_counts(self) -> dict[str, int]:
        """How often the overlap hooks worked: reduce-scatters launched from backward hooks, deferred
        all-gathers finished by a forward pre-hook (both 0 without overlap)."""
        return {"launched_reduces": self._overlap.launched_reduces, "waited_gathers": self._overlap.waited_gathers}

    @property
    def fold_counts(self) -> dict[str, int]:
        """``fold_grad_norm``: sums of squares folded in backward, and right before a step because backward had
        not (graphstep.step.folded_sums). A loop that gets the fold's benefit keeps the second at 0."""
        return self._fold.counts()

    def no_sync(self):
        """Grad accumulation: backward inside only accumulates. The reduce-scatters (``overlap_grad_reduce``)
        and the folded norm (``fold_grad_norm``) run in the last micro-batch's backward, outside it."""
        return self._no_sync()

    @torch.no_grad()
    def publish_params(self) -> None:
        """Copy the main params into the model params (and all-gather them across data-parallel ranks):
        what a checkpoint load runs after copying into the main params. Collective with several ranks."""
        self._offload.publish()  # CPU offload's host part first; the device part and the all-gathers follow
        self._publish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every grad in place (``set_to_none`` is ignored: the grad buffers are static)."""
        for buffers in self._domain_buffers():
            buffers.zero_grad()
        self._fold.invalidate()

    def _domain_buffers(self) -> list[StaticBuffers]:
        """Every domain's buffers, the dense params' first."""
        return [domain.buffers for domain in self.domains]

    # Read-only conveniences over ``domains`` (tests, tools, the dense-only checkpoint code): the dense domain's
    # Layout and StaticBuffers, and the MoE expert params' Domain or None (graphstep/plan/experts.py).
    layout = property(lambda self: self.domains[0].layout)
    buffers = property(lambda self: self.domains[0].buffers)
    experts = property(lambda self: domains_mod.with_role(self.domains, domains_mod.EXPERTS))

    # ---- checkpoints -----------------------------------------------------------------------------------
    @runs_state_dict_hooks
    def state_dict(self) -> dict:
        """This rank's flat buffers, exact, for ``torch.save`` flows at the same layout
        (graphstep.checkpoint.state_dict)."""
        return state_dict_mod.state_dict(self)

    @runs_load_state_dict_hooks
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
