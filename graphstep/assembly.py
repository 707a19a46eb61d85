"""The engine's build: a pure function of the config, the model and its process groups, returning a frozen record.

``route`` sorts the model's trainable params into param groups (before torch's ``Optimizer`` normalises them);
``build`` then runs the steps below in the order they are called there, each a small function that takes what
it reads and returns what it makes, and collects everything into one ``Build`` record. The optimizer object
(graphstep/engine.py) holds the record and is a façade over it; modules that need parts of the engine
(checkpoints, the debug step, memory stats) are handed those parts, never the optimizer.

An FSDP2 model's optimizer (graphstep/fsdp2/optimizer.py) hands its local shards in as ``LocalShardInput``: the
build lays those out instead of the params, and binds FSDP2's tensors to the flat buffers.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from capture.devices import backend_for
from capture.profile import Ranges

from . import offload
from .checkpoint.torch_api import ParamState
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
from .kernels import auto, choose_kernels
from .parallel import teardown
from .parallel.agreement import agreement_for
from .parallel.collectives import Collectives, data_parallel_group
from .plan import model_parallel
from .plan.experts import is_expert_param
from .plan.layout import Layout, plan_layout
from .plan.model_params import as_chunks, named_model_params, named_trainable_params, param_spec, warn_dtype_conversion
from .plan.routing import build_family_param_groups
from .pre_step import ParamCheckSchedule
from .run.result import StepResult
from .run.runner import StepRunner
from .state.allocation import allocate
from .state.group_watch import GroupWatch
from .state.hyperparams import HyperParams
from .state.param_writes import ParamWrites
from .state.precision import main_compute_dtype, main_storage, storage_by_state
from .step import compiled_scalar_math, folded_sums
from .step import domains as domains_mod
from .step.chain import default_chain, publish_chain
from .step.scaler import scaler_from_config
from .step.stages import StepTensors, baked_values, chain
from .step.stages.context import StepContext
from .step.torch_amp import TorchGradScaler


@dataclass(frozen=True)
class ProcessGroups:
    """The groups ``get_optimizer`` was given (None: not given); graphstep/factory.py documents each."""
    data_parallel: Any = None
    model_parallel: Any = None
    expert_data_parallel: Any = None
    tensor_parallel: Any = None
    expert_tensor_parallel: Any = None

    def any_given(self) -> bool:
        return any(g is not None for g in (self.data_parallel, self.model_parallel, self.expert_data_parallel,
                                           self.tensor_parallel))


@dataclass(frozen=True)
class LocalShardInput:
    """An FSDP2 model's params as the build lays them out (graphstep/fsdp2/optimizer.py supplies it)."""
    shards: tuple
    """graphstep/fsdp2/shards.py's ``LocalShard`` per trainable param, in the model's order."""
    check_families: Callable[[list], None]
    """Called with the family of each shard: refuses a family that cannot update these shards."""
    bind: Callable[[Any], Any]
    """Called with the dense ``StaticBuffers``: points FSDP2's tensors at them and returns the bindings (``check``
    before each step, ``rebind_grads`` after ``zero_grad``, ``grads_taken_at_build``)."""


@dataclass(frozen=True)
class Routed:
    """The model's trainable params sorted into param groups: what torch's ``Optimizer.__init__`` takes."""
    config: OptimizerConfig
    chunks: list  # the model's modules
    model_chunks: Any  # as given: an nn.Module or a list of them
    model_named: list  # (name, param) per trainable param; DTensors for an FSDP2 model
    groups: list


@dataclass(frozen=True)
class Build:
    """Everything ``build`` made, in one frozen record; the optimizer is a façade over it."""
    config: OptimizerConfig
    families: tuple  # one Family per param group
    device: torch.device
    rank: int  # in the data-parallel group
    hyper: HyperParams
    scaler: Any  # the loss scaler, or None
    tensors: StepTensors
    comm: Collectives
    kernel_choice: Any
    domains: tuple  # the dense domain, then the MoE expert params' (graphstep/step/domains.py)
    stages: list  # the device step's stages, in order
    host_stages: list  # CPU offload's host update: after the device step, never captured
    host_tensors: dict  # {kind: host buffers}
    ranges: Ranges
    runner: StepRunner
    result: StepResult  # what step() returns: static device tensors
    param_state: Any  # the ``Optimizer.state`` mapping
    torch_amp: TorchGradScaler
    grad_hooks: GradHooks
    offload: Any
    model_chunks: tuple  # weak references to the model's modules (for debug_step)
    model_state_dict: Any
    no_sync: NoSync
    overlap: Any
    publish: Callable[[], None]
    grads_seen: GradsSeen
    replaced_params: ReplacedParams
    requires_grad: RequiresGradWatch
    param_checks: ParamCheckSchedule  # when the checks that read every param run
    group_watch: GroupWatch
    fold: Fold
    ddp: Any
    param_writes: tuple  # one ParamWrites per domain
    shard_bindings: Any  # an FSDP2 model's bindings (graphstep/fsdp2/bindings.py), or None
    local_shards: Optional[tuple]  # an FSDP2 model's local shards, or None

    @property
    def domain_buffers(self) -> list:
        """Every domain's ``StaticBuffers``, the dense params' first."""
        return [domain.buffers for domain in self.domains]


def route(config, model_chunks, config_overrides, local_shards: Optional[LocalShardInput]) -> Routed:
    """Check the config, read the model's trainable params and route each to its family's param group."""
    if not isinstance(config, OptimizerConfig):
        raise TypeError(f"get_optimizer: config must be an OptimizerConfig, got {type(config).__name__}")
    model_named = named_trainable_params(model_chunks, dtensors=local_shards is not None)
    chunks = as_chunks(model_chunks)
    ddp.check_at_build(chunks, config.use_distributed_optimizer)
    # Validates the overrides; routes each param to its optimizer family (the groups' "optimizer" key).
    groups = build_family_param_groups(model_named, config, config_overrides, model_chunks=model_chunks)
    return Routed(config, chunks, model_chunks, model_named, groups)


def build(routed: Routed, param_groups: list, groups: ProcessGroups,
          local_shards: Optional[LocalShardInput] = None) -> Build:
    """The engine over ``routed`` params, grouped as torch normalised them (``param_groups``), in the order its
    parts depend on each other."""
    config = routed.config
    params = _laid_out(routed, param_groups, local_shards)
    plan = _plan(config, params, groups)
    host, buffers = _allocate(config, params, plan)
    hyper, scaler, tensors, torch_amp = _scalars(config, params.device, len(param_groups))
    param_state = _param_state(routed.model_named, tensors, local_shards)
    comm = _collectives(config, params, plan, groups)  # the one build-time exchange with the other ranks
    kernels, kernel_choice = _kernels(config, params, comm, hyper, plan, buffers, scaled=scaler is not None)
    ctx = StepContext(config, plan.layout, buffers, hyper, kernels, params.families, tensors, scaler, comm, plan.rank,
                      torch_amp=torch_amp,
                      compile_scalars=compiled_scalar_math.wanted(kernel_choice.name, params.device),
                      folded=folded_sums.plan(config, plan.layout, buffers, hooked=True))
    domains = _domains(config, params, plan, ctx)
    grad_hooks = _grad_hooks(domains)
    installed = offload.install(ctx, host, routed.model_chunks)  # inert without CPU offload
    # The model's modules, weakly (the optimizer never keeps a dropped model alive): for debug_step.
    model_chunks = tuple(weakref.ref(chunk) for chunk in routed.chunks)
    # The model's state-dict hooks: they outlive the optimizer.
    state_dict_hooks = model_state_dict.install(routed.chunks, [d.buffers for d in domains])
    stages = installed.adjust_chain(default_chain(domains))
    ranges = Ranges()
    runner = _runner(config, params.device, domains, hyper, tensors, stages, ranges, comm)
    no_sync = NoSync()  # opt.no_sync(): read by the overlap and the folded norm's hooks
    overlap = grad_overlap.install(domains, config, routed.model_chunks, may_capture=runner.may_capture,
                                   no_sync=no_sync, hooks=grad_hooks)
    publish = chain(publish_chain(domains))
    bindings = None if local_shards is None else local_shards.bind(buffers)  # FSDP2's tensors at the flat buffers
    grads_seen = GradsSeen(grad_hooks, [d.buffers for d in domains],
                           taken_at_build=bool(bindings is not None and bindings.grads_taken_at_build),
                           foreign_params=[] if local_shards is None else [s.param for s in local_shards.shards])
    replaced_params = ReplacedParams(routed.chunks, params.named)  # kept through close(): later steps still train
    # The model's params, not FSDP2's stand-ins.
    requires_grad = RequiresGradWatch(named_model_params(routed.chunks), routed.model_named,
                                      [d.buffers for d in domains])
    group_watch = GroupWatch(param_groups)
    fold = Fold([d.ctx.folded for d in domains], buffers, no_sync, grad_hooks)  # inert without the fold
    ddp_watch = ddp.DdpWatch(routed.chunks, distributed_optimizer=config.use_distributed_optimizer,
                             explicit_groups=groups.any_given(), on_ddp=fold.fold_before_step,
                             hooks=grad_hooks)
    result = StepResult(tensors.update_successful, tensors.grad_norm, tensors.num_zeros, tensors.loss_scale,
                        tensors.skipped_steps)
    # bf16/fp16 params' writes, through the params or their state-dict aliases
    param_writes = tuple(ParamWrites(d.buffers, state_dict_hooks) for d in domains)
    return Build(
        config=config, families=tuple(params.families), device=params.device, rank=plan.rank, hyper=hyper,
        scaler=scaler, tensors=tensors, comm=comm, kernel_choice=kernel_choice, domains=domains, stages=stages,
        host_stages=installed.host_stages, host_tensors=installed.host_tensors, ranges=ranges, runner=runner,
        result=result, param_state=param_state, torch_amp=torch_amp, grad_hooks=grad_hooks, offload=installed,
        model_chunks=model_chunks, model_state_dict=state_dict_hooks, no_sync=no_sync, overlap=overlap,
        publish=publish, grads_seen=grads_seen, replaced_params=replaced_params, requires_grad=requires_grad,
        param_checks=ParamCheckSchedule(config.param_checks), group_watch=group_watch, fold=fold, ddp=ddp_watch, param_writes=param_writes, shard_bindings=bindings,
        local_shards=None if local_shards is None else tuple(local_shards.shards))


# ---- the steps, in the order build() calls them -------------------------------------------------------------
@dataclass(frozen=True)
class _Params:
    named: list  # (name, tensor) per trainable param, in order: what the flat buffers hold
    group_index: list  # each one's param group
    families: list  # one Family per param group
    device: torch.device


def _laid_out(routed: Routed, param_groups: list, local_shards: Optional[LocalShardInput]) -> _Params:
    """What the flat buffers hold: the params themselves, or an FSDP2 model's local shards; all on one device."""
    config, model_named = routed.config, routed.model_named
    group_of = {id(p): g for g, group in enumerate(param_groups) for p in group["params"]}
    group_index = [group_of[id(p)] for _, p in model_named]
    families = families_of(param_groups, config.optimizer)
    named = model_named
    if local_shards is not None:
        if [name for name, _ in model_named] != [s.name for s in local_shards.shards]:
            raise ValueError("graphstep: the FSDP2 model's params changed while the optimizer was being built")
        local_shards.check_families([families[g] for g in group_index])
        named = [(s.name, s.local) for s in local_shards.shards]
    device = named[0][1].device
    for name, p in named:
        if p.device != device:
            raise ValueError(f"param '{name}' is on {p.device}, others on {device}: put the model on one "
                             "device before get_optimizer")
    warn_dtype_conversion(config, named)
    fp8_support.check_against_config(config, named)
    return _Params(named, group_index, families, device)


@dataclass(frozen=True)
class _Plan:
    specs: list
    model_parallel_group: Any
    dp_group: Any
    rank: int
    dp_size: int
    dense_indices: list
    expert_plans: list
    layout: Layout


def _plan(config, params: _Params, groups: ProcessGroups) -> _Plan:
    """Each param's spec, the data-parallel group, the MoE expert plans (experts.py) and the dense layout."""
    mp_group, norm_counting = model_parallel.resolve(params.named, groups.model_parallel, groups.tensor_parallel,
                                                     groups.expert_tensor_parallel)
    specs = [param_spec(config, name, p, g, params.families[g].batch_by_shape, norm_counting.counts(p))
             for (name, p), g in zip(params.named, params.group_index)]
    dp_group, rank, dp_size = data_parallel_group(config, groups.data_parallel)
    dense_indices, expert_plans = domains_mod.plan(config, params.named, groups.expert_data_parallel, dp_group, dp_size,
                                                   mp_group, groups.expert_tensor_parallel)
    layout = plan_layout([specs[i] for i in dense_indices], dp_size, config.bucket_size)
    return _Plan(specs, mp_group, dp_group, rank, dp_size, dense_indices, expert_plans, layout)


def _allocate(config, params: _Params, plan: _Plan) -> tuple:
    """(the host part of this rank's shard with CPU offload, else None; the dense domain's StaticBuffers)."""
    names = state_names(params.families, config)
    # Hybrid CPU offload first, so that the device buffers are allocated for the device part only (dense only).
    host = offload.prepare_host(config, plan.layout, plan.rank, params.device, names, len(params.families),
                                experts=bool(plan.expert_plans))
    dense = [params.named[i][1] for i in plan.dense_indices]
    buffers = allocate(plan.layout, dense, rank=plan.rank, device=params.device, main_dtype=main_compute_dtype(config),
                       state_names=names, host=host,
                       group_states=[family.state_names(config) for family in params.families],
                       state_storage=storage_by_state(config, names), main_storage=main_storage(config))
    return host, buffers


def _scalars(config, device, num_groups: int) -> tuple:
    """(hyperparameter tensors, loss scaler or None, the step's static tensors, torch's GradScaler's side)."""
    hyper = HyperParams(num_groups, device)
    scaler = scaler_from_config(config, device)
    scaled = scaler is not None
    tensors = StepTensors.allocate(device, scaler.scale if scaled else None, scaler.inv_scale if scaled else None,
                                   config.log_num_zeros_in_grad)
    return hyper, scaler, tensors, TorchGradScaler(tensors, own_scaler=scaled)


def _param_state(model_named: list, tensors: StepTensors, local_shards: Optional[LocalShardInput]):
    """torch's ``Optimizer.state``: each param's entry names the one step count the flat buffers share.

    graphstep's state lives in the flat buffers (``opt.state_dict()``, ``gs.checkpoint``); torch's
    get/set_state_dict get torch's format through state_dict() / load_state_dict()
    (graphstep/checkpoint/torch_format.py). An FSDP2 model's optimizer keeps torch's plain mapping, which
    torch.distributed.checkpoint reads (graphstep/fsdp2/state_dict.py)."""
    state = ParamState(dict) if local_shards is None else collections.defaultdict(dict)
    for _, p in model_named:
        state[p]["step"] = tensors.step
    return state


def _collectives(config, params: _Params, plan: _Plan, groups: ProcessGroups) -> Collectives:
    comm = Collectives(plan.dp_group, plan.dp_size, plan.model_parallel_group, timeout_s=config.distributed_timeout_s,
                       tp_group=groups.tensor_parallel)
    # Expert params that joined the dense layout keep their own TP group, which Muon cannot gather over here.
    if not plan.expert_plans and not model_parallel.same_ranks(groups.tensor_parallel, groups.expert_tensor_parallel):
        comm.experts_split_elsewhere = frozenset(name for name, p in params.named if is_expert_param(p))
    # All ranks agree on the layout and config before any stage pairs up buffers (and the model-parallel group
    # gets its timeout). No stage factory talks to peers.
    comm.setup(plan.layout, config, params.device)
    return comm


def _kernels(config, params: _Params, comm: Collectives, hyper: HyperParams, plan: _Plan, buffers, *,
             scaled: bool) -> tuple:
    """(the update kernels, the choice: which one runs with ``kernel="auto"`` resolved, why, compile seconds)."""
    layout = plan.layout
    # The probe of the compiled kernel runs over views cut like the step's, so that it compiles the step's own
    # variant and a cold process compiles once. The grad scale is guessed from the build (a loss scaler or a
    # clip): torch's GradScaler hands one over only at the step; a wrong guess costs a second compile, never a
    # different result.
    one_loop_groups = [g for g, family in enumerate(params.families)
                       if family.kernels is None and family.call_groups is not None]
    like = auto.step_shape(layout.segments(plan.rank), one_loop_groups, decoupled=config.decoupled_weight_decay,
                           scaled=scaled or config.clip_grad > 0)
    moments = [*buffers.state.get("exp_avg", []), *buffers.state.get("exp_avg_sq", [])]
    native = like is not None and bool(moments) and auto.native_runs_every_call(
        params.device, params.families, one_loop_groups, [*buffers.main_shard, *buffers.grad_shard, *moments],
        full_width=not buffers.stored and buffers.host is None)
    kernels, choice = choose_kernels(config, params.device, params.families, comm, hyper.values.dtype,
                                     numel=sum(buffer.shard_numel for buffer in layout.buffers), like=like,
                                     native=native)
    if choice.name == "compiled" and config.capture_warmup_steps < 1 \
            and backend_for(params.device, config.capture)[0] != "eager":
        # The config refuses capture="graph" so; "auto" captures where the device has CUDA graphs.
        raise ValueError(f"graphstep: kernel='compiled' compiles on its first step, which must run before the "
                         f"step is captured (capture={config.capture!r} captures on {params.device}): use "
                         "capture_warmup_steps >= 1")
    return kernels, choice


def _domains(config, params: _Params, plan: _Plan, ctx: StepContext) -> tuple:
    """The sharding domains (graphstep/step/domains.py): the dense params', then the expert params' if any."""
    dense = domains_mod.Domain(domains_mod.DENSE, plan.layout, ctx.buffers, ctx.comm, ctx)
    return (dense, *[domains_mod.build_expert_domain(dense, expert_plan, plan.specs, [p for _, p in params.named],
                                                     device=params.device,
                                                     state_names=state_names(params.families, config))
                     for expert_plan in plan.expert_plans])


def _grad_hooks(domains: tuple) -> GradHooks:
    """The one post-accumulate-grad hook per param: the main grads, grads-seen flag, fold and overlap listen to
    it, in the order param_hooks.STAGES declares (not the order of the statements here)."""
    hooks = GradHooks()
    for domain in domains:
        domain.buffers.listen_for_main_grads(hooks)
    return hooks


def _static_inputs(domains: tuple, hyper: HyperParams, tensors: StepTensors):
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


def _runner(config, device, domains: tuple, hyper: HyperParams, tensors: StepTensors, stages: tuple, ranges: Ranges,
            comm: Collectives) -> StepRunner:
    """Runs the chain of stages: eagerly, or captured and replayed (capture/)."""
    runner = StepRunner(
        step_fn=chain(stages), eager_step_fn=chain(stages, ranges=ranges), device=device,
        mode=config.capture, warmup_steps=config.capture_warmup_steps, invalidation=config.capture_invalidation,
        static_inputs=_static_inputs(domains, hyper, tensors), baked_values=baked_values(stages),
        agree=_agreement(config, device, comm))
    step_groups = [g for d in domains for g in (d.comm.dp_group, d.comm.mp_group, d.comm.tp_group) if g is not None]
    if step_groups and runner.may_capture:
        # NCCL cannot destroy a communicator while a CUDA graph holds its collectives: the captured step goes
        # first, whichever way the job is torn down (graphstep/parallel/teardown.py).
        teardown.release_before_teardown(runner, step_groups)
    return runner
