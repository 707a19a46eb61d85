"""Hybrid CPU offload: the optimizer state and update of part of the params on the host.

Unlike Megatron-Core's ``HybridDeviceOptimizer``, the step keeps graphstep's shape: the device step stays
captured and copies the host part's grads and the step's ``grad_scale`` / ``found_inf`` to the host; one host
wait (an event) follows it; the host update runs torch's kernels with the device's skip and scale, every
hyperparameter read fresh; then eager H2D copies. The copies are not a second graph: they are a few launches,
a second graph would need its own guards and recapture agreement, and the CPU replay backend refuses
host-to-device copies, so it could not be tested here. With ``overlap_cpu_optimizer_d2h_h2d`` the host part
runs chunk by chunk on a worker thread (graphstep/offload/overlap.py). Which params: graphstep/offload/plan.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..plan.layout import Layout
from ..families import FAMILIES, StepScalars
from ..step.stages import Stage, grad_prescale
from ..step.stages.gather import bucket_gathers
from .chunks import build_chunks, flat_pieces
from .host import HostShards
from .overlap import ChunkWorker
from .plan import OffloadPlan, host_buckets, plan_offload

__all__ = ["HostShards", "Offload", "OffloadPlan", "host_buckets", "install", "plan_offload", "prepare_host"]



def prepare_host(config, layout: Layout, rank: int, device, state_names, num_groups: int, *,
                 experts: bool = False) -> Optional[HostShards]:
    """The host buffers for ``config``'s offload fraction, or None without ``optimizer_cpu_offload``.
    ``experts``: the engine has an expert domain (graphstep.plan.experts), which offload does not cover."""
    if not config.optimizer_cpu_offload:
        return None
    if experts:
        raise ValueError("optimizer_cpu_offload with an expert_data_parallel_group: offload covers the dense "
                         "params only and is not supported together with expert data-parallel groups yet; "
                         "turn one of them off")
    plan = plan_offload(layout, rank, config.optimizer_offload_fraction)
    return HostShards(plan, layout, main_dtype=config.main_params_dtype, state_names=state_names,
                      num_groups=num_groups, device=device, pin_grads=config.pin_cpu_grads,
                      pin_params=config.pin_cpu_params)


def install(ctx, host: Optional[HostShards], model_chunks=None):
    """The engine's offload part: an ``Offload`` over ``host``, or an inert one without CPU offload."""
    return NoOffload() if host is None else Offload(ctx, host, model_chunks)


def _grad_copies(ctx, host: HostShards) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(host grads view, device grads view) pairs: the reduced grads of each buffer's host part, which
    are host offsets ``[0, host_size)`` = shard offsets ``[split, shard_numel)``; with several ranks each
    bucket's reduce-scatter wrote its piece in place, in ``grad_flat`` at the bucket's shard range."""
    copies = []
    for b in range(len(ctx.layout.buffers)):
        split, size = host.plan.splits[b], host.plan.host_size(b)
        grad_flat = ctx.buffers.grad_flat[b]
        for flat, start, numel in flat_pieces(ctx, b, split, split + size):
            copies.append((host.grads[b][start - split:start - split + numel], grad_flat[flat:flat + numel]))
    return copies


class NoOffload:
    """What the engine holds without CPU offload: the same calls, doing nothing."""

    host_stages: tuple = ()
    waited_chunks = 0

    def __init__(self):
        self.host_tensors: dict = {}

    def adjust_chain(self, stages: list[Stage]) -> list[Stage]:
        return stages

    def after_device_step(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def publish(self) -> None:
        pass

    def remove(self) -> None:
        pass


class Offload:
    """The offload part of one engine: the D2H stage, the host update, the H2D copies (module docstring)."""

    def __init__(self, ctx, host: HostShards, model_chunks=None):
        for g, family in enumerate(ctx.families):
            if not family.offload:
                supported = [name for name, f in FAMILIES.items() if f.offload]
                raise ValueError(f"optimizer_cpu_offload: param group {g} uses optimizer={family.name!r}; the "
                                 f"host update runs {', '.join(supported)} only (route the group to one of them)")
        config = ctx.config
        self.host = host
        self.plan = host.plan
        self._ctx = ctx
        self._device = torch.device(ctx.buffers.param_flat[0].device)
        self._accelerator = self._device.type != "cpu"
        self._t = ctx.tensors
        self._hyper = ctx.hyper
        self._scaled, self._torch_amp = ctx.scaler is not None, ctx.torch_amp
        self._clip = ctx.hyper.position("clip_grad")
        self.overlap = config.overlap_cpu_optimizer_d2h_h2d
        if self.overlap and ctx.layout.dp_size > 1:
            raise ValueError("overlap_cpu_optimizer_d2h_h2d with the distributed optimizer over several ranks: "
                             "the post-update all-gathers would run from a worker thread; turn the overlap off")
        self.chunks = build_chunks(ctx, host, overlap=self.overlap)
        late = set(host_buckets(ctx.layout, config.optimizer_offload_fraction)) if ctx.layout.dp_size > 1 else set()
        gathers = bucket_gathers(ctx)
        self._early_gathers = [g for g in gathers if g[0] not in late]
        self._late_gathers = [g for g in gathers if g[0] in late]
        self._d2h = _grad_copies(ctx, host)
        # The host part's grads, pre-divided on the device where the loss-scaled grad scale splits, as the device
        # update's are (graphstep/step/stages/grad_prescale.py): the host kernel then divides by the finite rest.
        self._prescale = grad_prescale.GradPrescale([source for _, source in self._d2h], ctx.tensors,
                                                    ctx.buffers.scratch, "offload_grad_prescale") if self._d2h else None
        self._worker = ChunkWorker(self, model_chunks, ctx) if self.overlap else None
        self.host_stages = (Stage("offload_host", self.host_step),)
        """The never-captured part, as a stage (``debug_step`` runs it after the device stages)."""
        self.host_tensors = host.tensors()

    # ---- the captured part ---------------------------------------------------------------------------
    def adjust_chain(self, stages: list[Stage]) -> list[Stage]:
        """The device chain with the D2H stage after the update and, with several ranks, the gathers of
        buckets updated on the host taken out (they run after the H2D copies)."""
        out = []
        for stage in stages:
            if stage.name == "gather":
                if self._early_gathers:
                    out.append(Stage("gather", self._gather_early))
                continue
            out.append(stage)
            if stage.name == "update":
                out.append(Stage("offload_d2h", self._copy_to_host))
        return out

    def _loss_scaled(self) -> bool:
        """Whether the grads come loss-scaled: graphstep's scaler, or torch's GradScaler handing over its scale (a
        host choice the update stage reports as baked, so a capture follows it)."""
        return self._scaled or (self._torch_amp is not None and self._torch_amp.scaled)

    def _copy_to_host(self) -> None:
        async_grads, async_scalars = self.host.pinned_grads, self._accelerator and self.host.step.is_pinned()
        grad_scale = self._t.grad_scale
        if self._prescale is not None and self._loss_scaled():
            grad_scale = self._prescale()
        for target, source in self._d2h:
            target.copy_(source, non_blocking=async_grads)
        self.host.step.copy_(self._t.step, non_blocking=async_scalars)
        self.host.grad_scale.copy_(grad_scale, non_blocking=async_scalars)
        self.host.found_inf.copy_(self._t.found_inf, non_blocking=async_scalars)

    def _gather_early(self) -> None:
        comm = self._ctx.comm
        defer = comm.overlap_enabled and comm.defer_param_gather
        for bucket, whole, mine, what in self._early_gathers:
            comm.all_gather(whole, mine, what, key=("gather", bucket) if defer else None)

    # ---- the host part -------------------------------------------------------------------------------
    def after_device_step(self) -> None:
        """Run (or, with overlap, start) the host part; the engine calls it right after the device step."""
        if self._worker is not None:
            self._worker.start(self._record_event(), list(self._hyper.host_rows))
            return
        self.host_step()

    def host_step(self) -> None:
        """The one host wait, the host update, the H2D copies, then the late all-gathers."""
        event = self._record_event()
        if event is not None:
            event.synchronize()  # THE host wait of the step (see the module docstring)
        rows = list(self._hyper.host_rows)
        for chunk in self.chunks:
            self.update_chunk(chunk, rows)
            self.copy_chunk(chunk)
        comm = self._ctx.comm
        for _, whole, mine, what in self._late_gathers:
            comm.all_gather(whole, mine, what, key=None)

    def _record_event(self):
        if not self._accelerator:
            return None  # the CPU runs the device step synchronously: it is done already
        event = torch.Event(device=self._device)
        event.record()
        return event

    def update_chunk(self, chunk, rows) -> None:
        """Apply the update to one chunk of the host buffers, as the device update stage would."""
        host = self.host
        host.refresh_hyper(rows)
        clip_row, clip_column = self._clip
        grad_scale = host.grad_scale if self._loss_scaled() or rows[clip_row][clip_column] > 0 else None
        scalars = StepScalars(host.step, host.found_inf)
        config = self._ctx.config
        for call in chunk.calls:
            kwargs = {keyword: host.hyper[self._hyper.position(field, group)] for keyword, field, group in call.live}
            for keyword, row, column in call.baked:
                kwargs[keyword] = rows[row][column]
            call.family.call(call.kernels, call.views, scalars, config, grad_scale, **kwargs)

    def copy_chunk(self, chunk, stream=None) -> None:
        """The chunk's updated params to the device: cast into the staging buffer, then H2D."""
        non_blocking = self.host.pinned_params
        for staging, main in chunk.staging:
            staging.copy_(main)
        for target, source in chunk.copies:
            target.copy_(source, non_blocking=non_blocking)

    # ---- between steps -------------------------------------------------------------------------------
    def finish(self) -> None:
        """Wait for an overlapped host part still running (nothing to do without overlap)."""
        if self._worker is not None:
            self._worker.finish()

    def publish(self) -> None:
        """Copy the host main params into the model params (what a checkpoint load needs before the
        device's copy-back and all-gather)."""
        self.finish()
        for chunk in self.chunks:
            self.copy_chunk(chunk)

    @property
    def waited_chunks(self) -> int:
        """Chunks a forward pre-hook waited for (overlap only)."""
        return 0 if self._worker is None else self._worker.waited_chunks

    def remove(self) -> None:
        if self._worker is not None:
            self._worker.close()
