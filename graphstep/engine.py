"""The optimizer object users hold: ``get_optimizer`` (graphstep/factory.py) builds it, ``step`` runs the chain of
stages.

It is a ``torch.optim.Optimizer`` as far as torch's LR schedulers, ``param_groups`` and ``state_dict``
are concerned. Everything else about it is static: the build (graphstep/assembly.py) plans the layout and
allocates the buffers once and returns a frozen record of its parts; this object is a façade over that record,
and ``step`` only runs the pre-step checks (graphstep/pre_step.py) and applies the stage chain.
"""

from __future__ import annotations

import torch

from capture.devices import device_scope

from . import assembly
from . import families as families_mod
from . import pre_step
from .checkpoint import sharded
from .checkpoint import state_dict as state_dict_mod
from .checkpoint.optimizer_hooks import runs_load_state_dict_hooks, runs_state_dict_hooks
from .checkpoint.view import CheckpointView
from .config import OptimizerConfig
from .run.debug import StepReport, run_debug_step, trace_closure
from .run.memory import memory_stats
from .run.result import StepResult
from .step import domains as domains_mod


def _part(name: str, doc: str) -> property:
    """A read-only attribute of the optimizer: the build record's part ``name``."""
    return property(lambda self: getattr(self._build, name), doc=doc)


class GraphstepOptimizer(torch.optim.Optimizer):
    _step_supports_amp_scaling = True
    """torch's GradScaler hands its scale and inf flag to ``step`` instead of unscaling
    (graphstep/step/torch_amp.py)."""

    def __init__(self, config: OptimizerConfig, model_chunks, config_overrides=None, process_group=None,
                 model_parallel_group=None, expert_data_parallel_group=None, tensor_parallel_group=None,
                 expert_tensor_parallel_group=None, *, local_shards: "assembly.LocalShardInput | None" = None):
        """``local_shards``: an FSDP2 model's (graphstep/fsdp2/optimizer.py), laid out instead of its params."""
        routed = assembly.route(config, model_chunks, config_overrides, local_shards)
        self._building = True
        super().__init__(routed.groups, families_mod.torch_defaults(config))  # what schedulers see
        self._building = False
        groups = assembly.ProcessGroups(process_group, model_parallel_group, expert_data_parallel_group,
                                        tensor_parallel_group, expert_tensor_parallel_group)
        self._build = assembly.build(routed, self.param_groups, groups, local_shards)
        # torch's ``Optimizer.state`` (graphstep's own state lives in the flat buffers); an opt.state replaced
        # later (to reset it) is refused at the step.
        self.state = self._build.param_state
        self.clip_grad = config.clip_grad
        """Clip threshold, refreshed into a device tensor before each step: may change between steps."""
        self.grad_norm_skip_threshold = config.grad_norm_skip_threshold
        """Norm above which a step is skipped, refreshed like ``clip_grad``."""

    # The build record's parts users, tools and tests read (graphstep/assembly.py ``Build`` says what each is).
    config = _part("config", "The OptimizerConfig it was built with.")
    rank = _part("rank", "This process's rank in the data-parallel group.")
    device = _part("device", "The device the params, buffers and step live on.")
    hyper = _part("hyper", "The hyperparameter tensors, refreshed from param_groups before each step.")
    scaler = _part("scaler", "graphstep's loss scaler, or None.")
    tensors = _part("tensors", "The step's static scalar tensors (graphstep/step/stages).")
    comm = _part("comm", "The collectives over the data- and model-parallel groups.")
    kernel_choice = _part("kernel_choice", "Which update kernel runs (kernel='auto' resolved), why, compile seconds.")
    domains = _part("domains", "The sharding domains: the dense params', then the expert params' if any.")
    stages = _part("stages", "The device step's stages, in order.")
    host_stages = _part("host_stages", "CPU offload's host stages: after the device step, never captured.")
    host_tensors = _part("host_tensors", "{kind: host buffers} (CPU offload), else empty.")
    ranges = _part("ranges", "Profiler ranges: set ``opt.ranges.enabled = True`` for an NVTX / torch.profiler "
                             "range per stage of eager steps and one around each replay.")
    result = _part("result", "The StepResult every step returns (static device tensors).")
    local_shards = _part("local_shards", "An FSDP2 model's local shards (graphstep/fsdp2/shards.py), else None.")

    @property
    def build_record(self) -> assembly.Build:
        """Every part the build made (graphstep/assembly.py ``Build``), frozen: for tools and tests that inspect
        the engine's insides (its hooks, the fold, CPU offload's chunks). Read-only; its parts are internals whose
        shape may change between versions."""
        return self._build

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

    def _live_values(self) -> pre_step.LiveValues:
        """What a user may change on the optimizer between steps, as the pre-step checks read it."""
        thresholds = {"clip_grad": self.clip_grad, "grad_norm_skip_threshold": self.grad_norm_skip_threshold}
        return pre_step.LiveValues(self.param_groups, self.state, self.__dict__, thresholds)

    def _prepare(self) -> None:
        """Host-side work before the device step: the checks graphstep/pre_step.py declares, in its order."""
        pre_step.run_checks(self._build, self._live_values())

    def iteration_parts(self, model: torch.nn.Module, captures: bool):
        """What ``graphstep.Iteration`` runs around this optimizer's step (graphstep/iteration/engine_parts.py)."""
        from .iteration.engine_parts import parts_over

        def stepped() -> None:
            self._opt_called = True  # what torch's LR schedulers look for: the optimizer has stepped

        return parts_over(self._build, self._live_values, stepped, model, captures)

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
                self._build.runner.run()
                self._build.offload.after_device_step()  # CPU offload: never captured, the host update and H2D
            self._build.fold.after_step()
        # capture="auto" may have settled on eager at this step: the overlap hooks may run from now on.
        self._build.overlap.enabled = not self._build.runner.may_capture
        return self.result

    # ---- capture -------------------------------------------------------------------------------------
    @property
    def captured(self) -> bool:
        """Whether the step is captured now (later steps replay it)."""
        return self._build.runner.captured

    @property
    def capture_backend(self) -> str:
        """What runs the step: the capture backend's name (a CUDA graph, the CPU replay backend, or eager;
        see ``capture.devices.backend_for``)."""
        return self._build.runner.backend

    @property
    def recaptures(self) -> int:
        """How many times the captured step was captured again after going stale."""
        return self._build.runner.recaptures

    def reload_model_params(self) -> None:
        """Copy the model's params into the main params where they differ (Megatron-Core's name). The next step
        does this by itself for every param written in place (``model.load_state_dict``, ``nn.init``, a
        ``clamp_``); call it after a write no version counter sees, through ``p.data``."""
        for writes in self._build.param_writes:
            writes.copy_writes_into_main(everything=True)

    def check_params(self) -> None:
        """With ``param_checks="on_request"``: the next step reads every param again, as every step does by
        default (its data and grad still the flat buffers' views, its ``requires_grad`` as at the build). Call it
        after replacing, freezing or unfreezing a param, or after a grad was replaced or set to None."""
        self._build.param_checks.request()

    def recapture(self) -> None:
        """Adopt replaced params and buffers back into the static buffers; capture anew at the next step."""
        if self._build.shard_bindings is not None:
            self._build.shard_bindings.check()  # an FSDP2 model's grads and params back in the flat buffers
        for buffers in self._build.domain_buffers:
            buffers.restore_replaced_buffers()
            buffers.readopt_params()
        self._build.model_state_dict.adopt(self._build.domain_buffers)
        self._build.runner.invalidate()

    def close(self) -> None:
        """Release the captured step (its graph and memory pool) and the overlap hooks (the fold's and the
        grads-seen flag's too; the fp32 main grads keep accumulating through a param's one hook). Later steps
        run eagerly. Idempotent; the optimizer is also a context manager that closes on exit."""
        self._build.runner.close()
        self._build.overlap.remove()
        self._build.offload.remove()
        self._build.grads_seen.remove()
        self._build.fold.remove()
        self._build.ddp.remove()

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
        build = self._build
        trace = trace_closure(build.model_chunks, closure)
        with torch.no_grad():
            build.param_checks.request()  # a debugging step reads every param, whatever ``param_checks`` says
            self._prepare()
            build.fold.warn_out_of_date()
            report = run_debug_step(build.domains, (*build.stages, *build.host_stages), build.device, build.tensors,
                                    trace)
            self._build.fold.after_step()
            return report

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Bytes this rank's optimizer holds, by kind, on device and host, with totals (graphstep.run.memory)."""
        build = self._build
        scalars = list(build.tensors.named().values()) + [build.hyper.values]
        if build.scaler is not None:
            scalars += [t for t in vars(build.scaler).values() if isinstance(t, torch.Tensor)]
        return memory_stats(build.domains, build.host_tensors, scalars, build.runner.pool_bytes())

    def finish_param_gather(self) -> None:
        """Wait for all-gathers deferred by ``overlap_param_gather``: call before reading params outside a
        forward (a forward waits for them itself)."""
        self._build.overlap.finish()
        self._build.offload.finish()

    @property
    def overlap_counts(self) -> dict[str, int]:
        """How often the overlap hooks worked: reduce-scatters launched from backward hooks, deferred
        all-gathers finished by a forward pre-hook (both 0 without overlap)."""
        overlap = self._build.overlap
        return {"launched_reduces": overlap.launched_reduces, "waited_gathers": overlap.waited_gathers}

    @property
    def fold_counts(self) -> dict[str, int]:
        """``fold_grad_norm``: sums of squares folded in backward, and right before a step because backward had
        not (graphstep.step.folded_sums). A loop that gets the fold's benefit keeps the second at 0."""
        return self._build.fold.counts()

    def no_sync(self):
        """Grad accumulation: backward inside only accumulates. The reduce-scatters (``overlap_grad_reduce``)
        and the folded norm (``fold_grad_norm``) run in the last micro-batch's backward, outside it."""
        return self._build.no_sync()

    @torch.no_grad()
    def publish_params(self) -> None:
        """Copy the main params into the model params (and all-gather them across data-parallel ranks):
        what a checkpoint load runs after copying into the main params. Collective with several ranks."""
        self._build.offload.publish()  # CPU offload's host part first; the device part and the all-gathers follow
        self._build.publish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every grad in place (``set_to_none`` is ignored: the grad buffers are static)."""
        for buffers in self._build.domain_buffers:
            buffers.zero_grad()
        self._build.fold.invalidate()
        if self._build.shard_bindings is not None:
            self._build.shard_bindings.rebind_grads()  # grads a user set to None point at the flat grads again

    # Read-only conveniences over ``domains`` (tests, tools, the dense-only checkpoint code): the dense domain's
    # Layout and StaticBuffers, and the MoE expert params' Domain or None (graphstep/plan/experts.py).
    layout = property(lambda self: self.domains[0].layout)
    buffers = property(lambda self: self.domains[0].buffers)
    experts = property(lambda self: domains_mod.with_role(self.domains, domains_mod.EXPERTS))

    # ---- checkpoints -----------------------------------------------------------------------------------
    def checkpoint_view(self) -> CheckpointView:
        """What this optimizer's checkpoints read and write (graphstep/checkpoint/view.py): the checkpoint
        functions (``gs.checkpoint``, torch's state-dict API) take it instead of the optimizer."""
        build = self._build

        def set_thresholds(clip_grad, grad_norm_skip_threshold) -> None:
            self.clip_grad, self.grad_norm_skip_threshold = clip_grad, grad_norm_skip_threshold

        return CheckpointView(
            config=build.config, param_groups=self.param_groups, domains=build.domains, step=build.tensors.step,
            scaler=build.scaler, comm=build.comm, rank=build.rank, device=build.device,
            local_shards=build.local_shards,
            thresholds=lambda: (self.clip_grad, self.grad_norm_skip_threshold), set_thresholds=set_thresholds,
            finish_param_gather=self.finish_param_gather, publish_params=self.publish_params)

    @runs_state_dict_hooks
    def state_dict(self) -> dict:
        """This rank's flat buffers, exact, for ``torch.save`` flows at the same layout
        (graphstep.checkpoint.state_dict)."""
        return state_dict_mod.state_dict(self.checkpoint_view())

    @runs_load_state_dict_hooks
    def load_state_dict(self, state_dict: dict) -> None:
        """Load by copying into the existing buffers (addresses never change), then refresh model params."""
        state_dict_mod.load_state_dict(self.checkpoint_view(), state_dict)

    def sharded_state_dict(self) -> dict:
        """The reshardable per-param checkpoint format, this rank's slices as views of the live buffers
        (like torch's state dicts; ``gs.checkpoint.sharded_state_dict(opt, snapshot=True)`` copies)."""
        return sharded.entries(self.checkpoint_view())

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """Load the reshardable format from any data-parallel size or layout: validated, copied in place."""
        sharded.load(self.checkpoint_view(), state_dict)
