"""Overlap communication with backward and forward: hooks that launch and wait the step's collectives.

``overlap_grad_reduce``: when the last grad of a bucket lands in backward, the bucket's reduce-scatter is
launched asynchronously (while backward goes on with earlier layers), and the step's reduce stage only waits on
it. ``overlap_param_gather``: the step's gather stage only launches the all-gathers; a forward pre-hook on every
module that owns params waits on the buckets of its own params just before it runs, so the gathers overlap with
the rest of the step, the data loading and the first layers of the next forward.

``enabled`` switches all of it off at once: hooks then do nothing and the stages run their collectives
synchronously in the step. **It must be False while a capture records the step and while the captured
step replays**: the collectives are part of the graph then, and a hook launching one outside it would
pair up with nothing. All ranks must produce each bucket's grads in the same order (the same model and control
flow, as with DDP): collectives pair up by launch order.
"""

from __future__ import annotations

import torch

from ..plan.model_params import as_chunks
from ..step.stages.reduce import bucket_reduces
from . import weak_hooks
from .micro_batches import NoSync


class Overlap:
    """The hooks of one engine. ``enabled`` is what the engine (or a capture) flips; see the module doc.

    Backward: a listener on every param's post-accumulate-grad hook (stage "overlap", after the fp32 main
    grad's: graphstep/hooks/param_hooks.py) counts the bucket's grads that have arrived in this backward, and
    the last one launches the bucket's reduce-scatter. A bucket whose param got no grad in this backward is not
    launched by a hook; the step launches it in bucket order. Forward: the next step's reduce stage waits on
    whatever all-gather is still pending; ``finish()`` before reading params outside a forward (e.g.
    ``model.state_dict()`` right after the last step)."""

    def __init__(self, ctx, config, model_chunks=None, *, may_capture: bool, no_sync: NoSync, hooks):
        self._comm = ctx.comm
        self._buffers = ctx.buffers
        self.grad_reduce = bool(config.overlap_grad_reduce) and ctx.layout.dp_size > 1
        self.param_gather = bool(config.overlap_param_gather) and ctx.layout.dp_size > 1
        self._comm.defer_param_gather = self.param_gather
        self._handles = weak_hooks.Handles(self)  # the forward pre-hooks
        self._hooks = hooks  # the optimizer's GradHooks, which the grad listeners are added to
        self._no_sync = no_sync
        self.launched_reduces = 0  # reduce-scatters launched from backward hooks (for tests and stats)
        self.waited_gathers = 0  # deferred all-gathers finished by a forward pre-hook
        if self.grad_reduce:
            self._install_grad_hooks(ctx)
        if self.param_gather:
            self._install_forward_hooks(ctx, model_chunks)
        # A step that is or may be captured holds its collectives in the graph: the hooks stay off from the
        # start; the engine switches them on once the step is known to run eagerly (see StepRunner.may_capture).
        self.enabled = not may_capture

    @property
    def enabled(self) -> bool:
        """Whether the hooks act. Switched on only once the step is known to run eagerly, so no capture follows
        a launch; a reduce still pending when they are switched off (``close()``) is waited on by the step, not
        run again (it sums in place: graphstep/step/stages/reduce.py)."""
        return self._comm.overlap_enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._comm.overlap_enabled = bool(value) and (self.grad_reduce or self.param_gather)

    def finish(self) -> None:
        """Wait on every collective still in flight (deferred all-gathers, launched reduce-scatters)."""
        self._comm.wait_all("gather")

    def remove(self) -> None:
        """Remove every hook and listener (the engine's close()); the stages then run their collectives in the
        step."""
        self._handles.remove()
        self._hooks.remove(self)
        self.enabled = False

    # ---- backward: launch a bucket's reduce-scatter when its last grad arrives -----------------------
    def _install_grad_hooks(self, ctx) -> None:
        # fp16 grads are pre-scaled in place before their SUM: their buckets are never launched from hooks.
        self._reduces = {r.bucket: r for r in bucket_reduces(ctx) if r.overlappable}
        self._arrived: dict[int, set[int]] = {b: set() for b in self._reduces}
        self._folded = ctx.folded
        for bucket, reduce in self._reduces.items():
            for index in reduce.params:
                # Stage "overlap" runs after stage "main_grad" (param_hooks.STAGES): main_grad holds the grad.
                self._hooks.listen("overlap", self._buffers, index, self, "_grad_arrived", index, bucket)

    def _grad_arrived(self, index: int, bucket: int, param: torch.nn.Parameter) -> None:
        """Param ``index``'s listener, called only while the buffers own the param (a later optimizer over the
        same model may have taken it).

        Grad accumulation runs the earlier micro-batches under ``no_sync()``, so only the last backward launches
        the reduce-scatters. A bucket's reduce-scatter sums in place into the grad buffer (this rank's slice of
        it holds the sum afterwards), so a later backward into a bucket already launched cannot accumulate
        correctly: it raises, naming ``no_sync`` (Megatron-Core refuses the same)."""
        comm, folded, reduce = self._comm, self._folded, self._reduces[bucket]
        if not comm.overlap_enabled or self._no_sync.active:
            return
        # A grad set to None (model.zero_grad()) comes back as a fresh tensor: into the flat buffer.
        self._buffers.adopt_grad(index, param)
        arrived = self._arrived[bucket]
        if index in arrived or len(arrived) == len(reduce.params):
            # A new backward into this bucket. Normally the step consumed the last launch; if it is still
            # pending (or landed), this is grad accumulation into grads already summed in place.
            if comm.wait(("reduce", bucket)) or (folded is not None and bucket in folded.landed):
                raise RuntimeError(
                    f"graphstep: a backward reached bucket {bucket} again after its grad reduce-scatter was "
                    "launched (overlap_grad_reduce): it sums in place, so accumulating on top is wrong. Run "
                    "every micro-batch but the last under `with opt.no_sync():`, or step between backwards")
            arrived.clear()
        arrived.add(index)
        if len(arrived) == len(reduce.params):
            if folded is not None:
                self._land_launched()
            reduce.launch(comm, key=("reduce", bucket))
            self.launched_reduces += 1

    def _land_launched(self) -> None:
        """fold_grad_norm: before launching the next bucket, land those launched earlier (by now their
        reduce-scatters have had a layer of backward to run): wait, average, and fold their sums of squares
        while the shards are hot; the step then skips them (graphstep.step.folded_sums), so the norm is computed
        in backward and the step only waits on the last bucket. The wait orders the device stream after the
        collective; it blocks the host only where the backend does (gloo)."""
        for key in [k for k in self._comm.pending if k[0] == "reduce"]:
            self._comm.wait(key)
            bucket = key[1]
            self._reduces[bucket].finish()
            self._folded.fold(bucket)
            self._folded.landed.add(bucket)
            self._folded.in_backward_folds += 1

    # ---- forward: wait on a module's buckets just before it runs -------------------------------------
    def _install_forward_hooks(self, ctx, model_chunks) -> None:
        if model_chunks is None:
            raise ValueError("overlap_param_gather needs the model's modules to hook: pass model_chunks")
        chunks = as_chunks(model_chunks)
        bucket_of = {id(p): ctx.layout.params[i].bucket for i, p in enumerate(self._buffers.params)}
        # A module that owns params waits on the buckets of all its params, its children's included: some
        # modules use a child's params without calling the child (torch's MultiheadAttention reads
        # out_proj.weight directly). Containers without params of their own get no hook, so the forward
        # still waits bucket by bucket, layer by layer.
        for chunk in chunks:
            for module in chunk.modules():
                if not any(True for _ in module.parameters(recurse=False)):
                    continue
                buckets = sorted({bucket_of[id(p)] for p in module.parameters() if id(p) in bucket_of})
                if buckets:
                    hook = weak_hooks.calling(self, "_before_forward", tuple(buckets))
                    self._handles.append(module.register_forward_pre_hook(hook))

    def _before_forward(self, buckets: tuple[int, ...], module, args) -> None:
        if not self._comm.overlap_enabled:
            return
        for bucket in buckets:
            if self._comm.wait(("gather", bucket)):
                self.waited_gathers += 1


class Overlaps:
    """Every domain's hooks driven as one (the dense params' and the MoE expert params', each over its own
    group: graphstep/step/domains.py). Same interface as ``Overlap``; the counts are summed."""

    def __init__(self, parts: list[Overlap]):
        self._parts = parts

    @property
    def enabled(self) -> bool:
        return any(part.enabled for part in self._parts)

    @enabled.setter
    def enabled(self, value: bool) -> None:
        for part in self._parts:
            part.enabled = value

    @property
    def launched_reduces(self) -> int:
        return sum(part.launched_reduces for part in self._parts)

    @property
    def waited_gathers(self) -> int:
        return sum(part.waited_gathers for part in self._parts)

    def finish(self) -> None:
        for part in self._parts:
            part.finish()

    def remove(self) -> None:
        for part in self._parts:
            part.remove()


def install(domains, config, model_chunks=None, *, may_capture: bool, no_sync: NoSync, hooks) -> Overlaps:
    """The engine's overlap hooks, one ``Overlap`` per domain (graphstep/step/domains.py), each over its own
    collectives (inert when neither overlap option is on). ``may_capture``: the step is or may be captured,
    so the hooks start switched off. ``hooks``: the optimizer's ``GradHooks`` (graphstep/hooks/param_hooks.py),
    which the grad listeners join."""
    return Overlaps([Overlap(domain.ctx, config, model_chunks, may_capture=may_capture, no_sync=no_sync,
                             hooks=hooks) for domain in domains])
