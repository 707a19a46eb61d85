"""``graphstep.Iteration``: the whole training iteration (every micro-batch's forward and backward, the
data-parallel reduce, clip, skip and update) as one captured graph, with an eager twin running the same code;
``Iteration.evaluate``: the forward only, captured the same way (evaluation.py).

One call zeroes every grad in place, runs each of the k micro-batches' ``loss_fn`` and the backward of
``opt.scale_loss(loss / k)`` (all but the last under ``opt.no_sync()`` and DDP's ``no_sync()``, so grads are
reduced once), then the optimizer's step. The batch is first copied into static tensors of its signature
(inputs.py: shapes, dtypes, the number of micro-batches; with the model's train/eval flags): each signature gets
its own graph, captured on first sight after ``warmup`` eager runs, up to ``max_graphs``; one more is refused,
never padded. Before each run, on the host: the optimizer's checks and hyperparameter refresh, then what would
make a graph stale (params replaced by the user, a value the step bakes in, a module hook added or removed),
each making every graph capture again, with a warning. A host sync in ``loss_fn`` is refused, naming the line.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

import capture
from capture.baked import BakedValues
from capture.devices import backend_for, device_scope, is_cuda

from ..config.warn import warn_user
from .evaluation import StaticOutputs, evaluation_fn
from .inputs import StaticBatch, describe, signature
from .model_watch import ModelWatch

logger = logging.getLogger("graphstep")

DEFAULT_MAX_GRAPHS = 8
# Eager runs before a recapture: what made the graph stale may need lazy setup no capture may contain.
RECAPTURE_WARMUP = 1
# Recaptures in a row with no replay between: something the graph reads changes at every iteration.
RECAPTURE_WARNING_STREAK = 3
# What runs a signature: a training iteration, or an evaluation (graphstep/iteration/evaluation.py); each kind's
# profiler range around every call, eager or replayed.
TRAIN, EVALUATE = "train", "evaluate"
RANGE_NAMES = {TRAIN: "graphstep.iteration", EVALUATE: "graphstep.evaluate"}
_NO_RANGE = contextlib.nullcontext()


@dataclass(frozen=True)
class IterationResult:
    """Device tensors, overwritten by the next iteration: clone what you keep, ``.item()`` where you want a sync."""

    loss: torch.Tensor  # fp32, the mean of the micro-batches' losses (unscaled)
    grad_norm: torch.Tensor  # fp32, the unscaled global grad norm before clipping
    update_successful: torch.Tensor  # bool, False when the step was skipped (non-finite grads)
    loss_scale: torch.Tensor  # fp32, the scale the next backward uses
    skipped_steps: torch.Tensor  # int64, steps skipped since the optimizer was built


class _Entry:
    """One signature's static batch, the function its graph records, the graph, and (evaluations) its outputs."""

    def __init__(self, kind: str, batch: StaticBatch, k: int):
        self.kind, self.batch, self.k = kind, batch, k
        self.outputs = StaticOutputs() if kind == EVALUATE else None
        self.fn: Callable[[], None] = lambda: None
        self.graph: Optional[capture.Graph] = None


class Iteration:
    """One training iteration over ``model`` with ``optimizer`` (``gs.get_optimizer``), eager or captured.

    loss_fn:    ``loss_fn(model, batch) -> loss``: the micro-batch's mean loss (a one-element tensor); the
                iteration scales it (``opt.scale_loss(loss / k)``) and runs its backward
    capture:    "graph" (a CUDA graph on CUDA, the replay backend elsewhere), "eager" (the same code, never
                captured) or "auto" (captured on CUDA, eager elsewhere); default: the optimizer's config.capture
    warmup:     eager runs of each signature before its capture; default: config.capture_warmup_steps
    max_graphs: signatures kept (each its graph and static inputs), training and evaluation together; one more
                is refused
    eval_fn:    ``eval_fn(model, batch) -> tensor or nest of tensors``, what ``evaluate`` runs (default: loss_fn)

    Profiling: while ``optimizer.ranges.enabled``, each call runs in a range "graphstep.iteration" (evaluations:
    "graphstep.evaluate"); an eager call (eager mode, the warm-up) also has a range per micro-batch's forward
    and backward and one around the step, with the step's stage ranges in it. A replay is that one range: the
    graph replays no Python.
    """

    def __init__(self, model: torch.nn.Module, optimizer, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *,
                 capture: Optional[str] = None, warmup: Optional[int] = None, max_graphs: int = DEFAULT_MAX_GRAPHS,
                 name: str = "graphstep.iteration",
                 eval_fn: Optional[Callable[[torch.nn.Module, Any], Any]] = None):
        if not callable(loss_fn):
            raise TypeError(f"graphstep.Iteration: loss_fn must be callable (model, batch) -> loss, got {loss_fn!r}")
        if eval_fn is not None and not callable(eval_fn):
            raise TypeError(f"graphstep.Iteration: eval_fn must be callable (model, batch) -> tensors, got {eval_fn!r}")
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"graphstep.Iteration: max_graphs must be a positive int, got {max_graphs!r}")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.eval_fn = loss_fn if eval_fn is None else eval_fn
        self._ranged = False  # whether the call running now is eager with profiler ranges on
        self.device = optimizer.device
        mode = optimizer.config.capture if capture is None else capture
        self._backend, reason = backend_for(self.device, mode)
        self._parts = optimizer.iteration_parts(model, captures=self._backend != "eager")
        if reason is not None:
            logger.info("graphstep: %s", reason.replace("the step", "the iteration"))
        self._auto = mode == "auto"
        self._warmup = optimizer.config.capture_warmup_steps if warmup is None else warmup
        if not isinstance(self._warmup, int) or self._warmup < 0:
            raise ValueError(f"graphstep.Iteration: warmup must be a non-negative int, got {self._warmup!r}")
        self.max_graphs, self.name = max_graphs, name
        self._pool = torch.cuda.graph_pool_handle() if is_cuda(self.device) and self._backend != "eager" else None
        self._graphs: dict[tuple, _Entry] = {}
        self._loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self._baked = BakedValues(self._parts.baked)
        self._watch = ModelWatch(model)
        self._hooks = self._watch.hooks()
        self.recaptures = 0
        """How many times the graphs were dropped to be captured again (a replaced param, a baked value, a hook)."""
        self._streak, self._warned_streak = 0, False
        r = optimizer.result
        self.result = IterationResult(self._loss, r.grad_norm, r.update_successful, r.loss_scale, r.skipped_steps)

    # -- state -----------------------------------------------------------------------------------------------------
    @property
    def capture_backend(self) -> str:
        """What runs the iteration: "cuda" (a CUDA graph), "replay" (the CPU replay backend) or "eager"."""
        return self._backend

    @property
    def captured(self) -> bool:
        """Whether a graph is captured now (for any signature)."""
        return any(e.graph.captured for e in self._graphs.values())

    @property
    def num_graphs(self) -> int:
        """Signatures seen (each with its graph, captured once its warm-up is done)."""
        return len(self._graphs)

    # -- running ---------------------------------------------------------------------------------------------------
    def __call__(self, micro_batches: Optional[Sequence[Any]] = None, *, batch: Any = None) -> IterationResult:
        """Run one iteration over ``micro_batches`` (a list or tuple of batches; each a tensor or a nest of them), or
        over one ``batch``. Returns ``self.result`` (device tensors; no host sync)."""
        if (micro_batches is None) == (batch is None):
            raise TypeError("graphstep.Iteration: pass either a list of micro-batches or batch=... (one batch)")
        if batch is not None:
            micro_batches = [batch]
        elif not isinstance(micro_batches, (list, tuple)) or not micro_batches:
            raise TypeError("graphstep.Iteration: micro_batches must be a non-empty list or tuple of batches; pass "
                            "one batch as batch=...")
        with torch.no_grad():
            replaced = self._parts.prepare()
        self._run_signature(TRAIN, micro_batches, replaced)
        return self.result

    def evaluate(self, batch: Any) -> Any:
        """Run ``eval_fn(model, batch)`` under ``torch.no_grad()``: the forward only (no grads touched, no step),
        with the model in the mode it is in (call ``model.eval()`` first for dropout off). Captured like
        training, a graph per signature; the first evaluation of a signature runs eagerly. Returns what
        ``eval_fn`` returned, as static device tensors that the next evaluation of this signature overwrites
        (clone what you keep; no host sync). With several ranks every rank must call it at the same time."""
        with torch.no_grad():
            replaced = self._parts.take_back()
        entry = self._run_signature(EVALUATE, [batch], replaced)
        return entry.outputs.result

    def _run_signature(self, kind: str, micro_batches: Sequence[Any], replaced: list) -> _Entry:
        key = (signature(micro_batches), self._watch.mode(), kind)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._add(key, kind, micro_batches)
        self._settle_staleness(replaced, entry)
        with device_scope(self.device):
            entry.batch.copy_in(micro_batches)
            self._run(entry)
        return entry

    def _add(self, key: tuple, kind: str, micro_batches: Sequence[Any]) -> _Entry:
        if len(self._graphs) >= self.max_graphs:
            seen = "; ".join(f"{describe(k[0])}{' (evaluation)' * (k[2] == EVALUATE)}" for k in self._graphs)
            raise RuntimeError(f"graphstep.Iteration: a new input signature ({describe(key[0])}, "
                               f"{len(micro_batches)} micro-batches) would be graph {len(self._graphs) + 1}, over "
                               f"max_graphs={self.max_graphs} (seen: {seen}). Bucket sequence lengths into fewer "
                               "shapes, drop or pad the last partial batch yourself, or raise max_graphs (each graph "
                               "keeps its static inputs)")
        static = StaticBatch(micro_batches, self.device)
        entry = _Entry(kind, static, len(micro_batches))
        if kind == EVALUATE:
            # At least one eager run: it allocates the outputs, outside the pool a training replay reuses.
            entry.fn = evaluation_fn(self.model, self.eval_fn, static, entry.outputs,
                                     lambda: self._range("graphstep.forward"))
            warmup, outputs = max(self._warmup, 1), entry.outputs.named
        else:
            entry.fn, warmup, outputs = self._iteration_fn(entry), self._warmup, lambda: {"loss": self._loss}
        entry.graph = capture.graph(
            entry.fn, warmup=warmup, backend=self._backend, pool=self._pool,
            static_inputs=lambda: {**self._parts.static_inputs(), **static.named("batch"),
                                   **self._watch.named_buffers(), **outputs()},
            name=f"{self.name}{'.evaluate' * (kind == EVALUATE)}[{describe(key[0])}]", allow_rng=True,
            device=self.device,
            stale_hint="the iteration captures again by itself when params are replaced; call iteration.recapture() "
                       "after replacing other tensors it reads")
        self._graphs[key] = entry
        return entry

    def _range(self, name: str):
        """A profiler range inside the function a graph records: only on an eager call (a capture records the
        function without them)."""
        return self.optimizer.ranges(name) if self._ranged else _NO_RANGE

    def _iteration_fn(self, entry: _Entry) -> Callable[[], None]:
        parts, model, loss_fn, loss_sum, ranged = self._parts, self.model, self.loss_fn, self._loss, self._range
        scale_loss, no_sync = self.optimizer.scale_loss, self._no_sync

        def iteration() -> None:
            parts.zero_grads()
            loss_sum.zero_()
            micro_batches, k = entry.batch.micro_batches, entry.k
            for i, micro_batch in enumerate(micro_batches):
                with no_sync() if i < k - 1 else contextlib.nullcontext():
                    with ranged("graphstep.forward"):
                        loss = loss_fn(model, micro_batch)
                        _check_loss(loss)
                        loss_sum.add_(loss.detach())
                    with ranged("graphstep.backward"):
                        scale_loss(loss / k if k > 1 else loss).backward()
            if k > 1:
                loss_sum.div_(k)
            with torch.no_grad(), ranged("graphstep.step"):
                parts.before_update()
                (parts.ranged_update if self._ranged else parts.update)()
            parts.after_update()

        return iteration

    @contextlib.contextmanager
    def _no_sync(self):
        """An earlier micro-batch's backward: only accumulate (the optimizer's switch, and DDP's or FSDP2's)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.optimizer.no_sync())
            if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
                stack.enter_context(self.model.no_sync())
            elif hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2's fully_shard
                self.model.set_requires_gradient_sync(False)
                stack.callback(self.model.set_requires_gradient_sync, True)
            yield

    def _run(self, entry: _Entry) -> None:
        with self.optimizer.ranges(RANGE_NAMES[entry.kind]):
            self._run_graph(entry)

    def _call(self, graph: "capture.Graph") -> None:
        """One call of ``graph``; profiler ranges inside only where it runs the function eagerly."""
        self._ranged = self.optimizer.ranges.enabled and not graph.captured and not graph.capture_due
        try:
            graph()
        finally:
            self._ranged = False

    def _run_graph(self, entry: _Entry) -> None:
        graph = entry.graph
        was_captured, capturing = graph.captured, graph.capture_due
        try:
            self._call(graph)
        except capture.StaleInputError as error:
            # A tensor the graph reads moved without the engine seeing it (a model buffer replaced, say): capture
            # again over the current tensors; the replay refused before running anything.
            logger.warning("graphstep: a tensor the captured iteration reads moved; capturing again: %s", error)
            self._invalidate_all("a tensor the captured iteration reads moved")
            self._call(graph)
            was_captured = False
        except capture.CaptureError as error:
            if not (capturing and self._auto and not graph.capture_runs_ops):
                raise
            logger.warning("graphstep: capture='auto' could not capture the iteration (%s); it runs eagerly",
                           (str(error).splitlines() or [""])[0])
            self._to_eager()
            self._call(entry.graph)
            return
        if was_captured and graph.captured:
            self._streak = 0  # a replay went through
        if not was_captured and graph.captured:
            self._baked.record()
            if self._parts.agree is not None:
                self._parts.agree(False)  # the closing bracket of the capture: no rank replays before all recorded

    def _settle_staleness(self, replaced: list, entry: _Entry) -> None:
        """Decide (together with the other ranks) whether the graphs must be captured again before this run."""
        reason = None
        if replaced:
            reason = f"params or buffers replaced after capture: {', '.join(replaced[:5])}"
        if reason is None:
            changed = self._baked.change()
            if changed is not None:
                reason = f"a value baked into the captured step changed ({changed})"
        hooks = self._watch.hooks()
        if hooks != self._hooks:
            self._hooks = hooks
            reason = reason or "a module hook was added or removed after capture"
        if self._parts.agree is not None:
            # Several ranks: a moved input is one more rank-local reason, decided before any rank replays.
            reason = reason or entry.graph.stale_inputs()
            if self._parts.agree(reason is not None and self.captured) and reason is None:
                reason = "another rank's captured iteration went stale"
        if reason is not None and self.captured:
            warn_user(f"graphstep: {reason}; the iteration is captured again", RuntimeWarning)
            self._invalidate_all(reason)

    def _invalidate_all(self, reason: str) -> None:
        self.recaptures += 1
        self._streak += 1
        if self._streak >= RECAPTURE_WARNING_STREAK and not self._warned_streak:
            self._warned_streak = True
            warn_user(f"graphstep: the iteration was captured again {self._streak} times in a row without a "
                      f"replay, the last time because {reason}: it runs eagerly plus a capture at every "
                      "iteration. Keep what it reads in place (copy_ into params and buffers instead of "
                      "replacing them), or use capture='eager'", RuntimeWarning)
        logger.info("graphstep: recapturing the iteration: %s", reason)
        for entry in self._graphs.values():
            entry.graph.invalidate(warmup=RECAPTURE_WARMUP)
        self._baked.clear()

    def _to_eager(self) -> None:
        for entry in self._graphs.values():
            entry.graph.close()
            entry.graph = capture.graph(entry.fn, backend="eager", name=self.name)
        self._backend = "eager"

    def recapture(self) -> None:
        """Drop every captured graph; each signature runs eagerly once more, then is captured again."""
        self._invalidate_all("iteration.recapture()")

    def close(self) -> None:
        """Free every graph (and the shared memory pool). Later calls capture anew. Idempotent."""
        for entry in self._graphs.values():
            entry.graph.close()
        self._graphs.clear()

    def __enter__(self) -> "Iteration":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else \
            f"a tensor of shape {list(loss.shape)}" + ("" if loss.requires_grad else " that does not require grad")
        raise TypeError(f"graphstep.Iteration: loss_fn must return the micro-batch's loss as a one-element tensor "
                        f"that requires grad (reduce it, e.g. .mean()); it returned {what}")
