"""``graphstep.Iteration``: the whole training iteration (every micro-batch's forward and backward, the
data-parallel reduce, clip, skip and update) as one captured graph, with an eager twin running the same code.

    opt = gs.get_optimizer(config, model)
    def loss_fn(model, batch):                     # your forward: returns the micro-batch's mean loss
        inputs, targets = batch
        return model(inputs, targets)
    iteration = gs.Iteration(model, opt, loss_fn)  # capture: as config.capture, or capture="graph"|"eager"|"auto"
    for micro_batches in data:                     # a list of micro-batches (or iteration(batch=...) for one)
        result = iteration(micro_batches)          # device tensors: loss, grad_norm, update_successful; no sync
        sched.step()

What one call runs (the function a capture records): every grad zeroed in place; for each of the k
micro-batches its forward (``loss_fn``) and backward of ``opt.scale_loss(loss / k)``, all but the last under
``opt.no_sync()`` (and DDP's ``no_sync()``), so grads are reduced once, after the last; the optimizer's step.
``result.loss`` is the mean of the k losses, unscaled. The batch is copied first into static tensors of its
signature (``inputs.py``); each signature (shapes, dtypes, number of micro-batches, the model's train/eval
flags) gets its own graph, captured on first sight after ``warmup`` eager runs, and at most ``max_graphs``
are kept: one more is refused, never padded.

Before each run, on the host: the optimizer's checks and hyperparameter refresh (schedules work as with
``opt.step()``), then what would make a graph stale: params replaced by the user (taken back into the static
buffers), a value the step bakes in (a fused kernel's betas or weight decay), a module hook added or removed.
Each makes every graph capture again (after one eager run), with a warning. A host sync in ``loss_fn`` (an
``.item()``, ``if loss > x:``) cannot be captured: the capture refuses it, naming the line.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

import capture
from capture.baked import BakedValues
from capture.devices import backend_for, device_scope, is_cuda

from .inputs import StaticBatch, describe, signature
from .model_watch import ModelWatch

logger = logging.getLogger("graphstep")

DEFAULT_MAX_GRAPHS = 8
# Eager runs before a recapture: what made the graph stale may need lazy setup no capture may contain.
RECAPTURE_WARMUP = 1
# Recaptures in a row with no replay between: something the graph reads changes at every iteration.
RECAPTURE_WARNING_STREAK = 3


@dataclass(frozen=True)
class IterationResult:
    """Device tensors, overwritten by the next iteration: clone what you keep, ``.item()`` where you want a sync."""

    loss: torch.Tensor  # fp32, the mean of the micro-batches' losses (unscaled)
    grad_norm: torch.Tensor  # fp32, the unscaled global grad norm before clipping
    update_successful: torch.Tensor  # bool, False when the step was skipped (non-finite grads)
    loss_scale: torch.Tensor  # fp32, the scale the next backward uses
    skipped_steps: torch.Tensor  # int64, steps skipped since the optimizer was built


class _Entry:
    """One signature's static batch and graph."""

    def __init__(self, batch: StaticBatch, graph: "capture.Graph", k: int):
        self.batch, self.graph, self.k = batch, graph, k


class Iteration:
    """One training iteration over ``model`` with ``optimizer`` (``gs.get_optimizer``), eager or captured.

    loss_fn:    ``loss_fn(model, batch) -> loss``: the micro-batch's mean loss (a one-element tensor); the
                iteration scales it (``opt.scale_loss(loss / k)``) and runs its backward
    capture:    "graph" (a CUDA graph on CUDA, the replay backend elsewhere), "eager" (the same code, never
                captured) or "auto" (captured on CUDA, eager elsewhere); default: the optimizer's config.capture
    warmup:     eager runs of each signature before its capture; default: config.capture_warmup_steps
    max_graphs: signatures kept (each its graph and static inputs); one more is refused
    """

    def __init__(self, model: torch.nn.Module, optimizer, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *,
                 capture: Optional[str] = None, warmup: Optional[int] = None, max_graphs: int = DEFAULT_MAX_GRAPHS,
                 name: str = "graphstep.iteration"):
        if not callable(loss_fn):
            raise TypeError(f"graphstep.Iteration: loss_fn must be callable (model, batch) -> loss, got {loss_fn!r}")
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"graphstep.Iteration: max_graphs must be a positive int, got {max_graphs!r}")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.device = optimizer.device
        mode = optimizer.config.capture if capture is None else capture
        self._backend, reason = backend_for(self.device, mode)
        if self._backend != "eager":
            _refuse_fsdp2(model)
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
        key = (signature(micro_batches), self._watch.mode())
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._add(key, micro_batches)
        self._settle_staleness(replaced, entry)
        entry.batch.copy_in(micro_batches)
        with device_scope(self.device):
            self._run(entry)
        return self.result

    def _add(self, key: tuple, micro_batches: Sequence[Any]) -> _Entry:
        if len(self._graphs) >= self.max_graphs:
            seen = "; ".join(describe(k[0]) for k in self._graphs)
            raise RuntimeError(f"graphstep.Iteration: a new input signature ({describe(key[0])}, "
                               f"{len(micro_batches)} micro-batches) would be graph {len(self._graphs) + 1}, over "
                               f"max_graphs={self.max_graphs} (seen: {seen}). Bucket sequence lengths into fewer "
                               "shapes, drop or pad the last partial batch yourself, or raise max_graphs (each graph "
                               "keeps its static inputs)")
        static = StaticBatch(micro_batches, self.device)
        entry = _Entry(static, None, len(micro_batches))  # type: ignore[arg-type]
        entry.graph = capture.graph(
            self._iteration_fn(entry), warmup=self._warmup, backend=self._backend, pool=self._pool,
            static_inputs=lambda: {**self._parts.static_inputs(), **static.named("batch"),
                                   **self._watch.named_buffers(), "loss": self._loss},
            name=f"{self.name}[{describe(key[0])}]", allow_rng=True, device=self.device,
            stale_hint="the iteration captures again by itself when params are replaced; call iteration.recapture() "
                       "after replacing other tensors it reads")
        self._graphs[key] = entry
        return entry

    def _iteration_fn(self, entry: _Entry) -> Callable[[], None]:
        parts, model, loss_fn, loss_sum = self._parts, self.model, self.loss_fn, self._loss
        scale_loss, no_sync = self.optimizer.scale_loss, self._no_sync

        def iteration() -> None:
            parts.zero_grads()
            loss_sum.zero_()
            micro_batches, k = entry.batch.micro_batches, entry.k
            for i, micro_batch in enumerate(micro_batches):
                with no_sync() if i < k - 1 else contextlib.nullcontext():
                    loss = loss_fn(model, micro_batch)
                    _check_loss(loss)
                    loss_sum.add_(loss.detach())
                    scale_loss(loss / k if k > 1 else loss).backward()
            if k > 1:
                loss_sum.div_(k)
            with torch.no_grad():
                parts.before_update()
                parts.update()
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
        graph = entry.graph
        was_captured, capturing = graph.captured, graph.capture_due
        try:
            graph()
        except capture.StaleInputError as error:
            # A tensor the graph reads moved without the engine seeing it (a model buffer replaced, say): capture
            # again over the current tensors; the replay refused before running anything.
            logger.warning("graphstep: a tensor the captured iteration reads moved; capturing again: %s", error)
            self._invalidate_all("a tensor the captured iteration reads moved")
            graph()
            was_captured = False
        except capture.CaptureError as error:
            if not (capturing and self._auto and not graph.capture_runs_ops):
                raise
            logger.warning("graphstep: capture='auto' could not capture the iteration (%s); it runs eagerly",
                           (str(error).splitlines() or [""])[0])
            self._to_eager()
            entry.graph()
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
            warnings.warn(f"graphstep: {reason}; the iteration is captured again", RuntimeWarning, stacklevel=3)
            self._invalidate_all(reason)

    def _invalidate_all(self, reason: str) -> None:
        self.recaptures += 1
        self._streak += 1
        if self._streak >= RECAPTURE_WARNING_STREAK and not self._warned_streak:
            self._warned_streak = True
            warnings.warn(f"graphstep: the iteration was captured again {self._streak} times in a row without a "
                          f"replay, the last time because {reason}: it runs eagerly plus a capture at every "
                          "iteration. Keep what it reads in place (copy_ into params and buffers instead of "
                          "replacing them), or use capture='eager'", RuntimeWarning, stacklevel=4)
        logger.info("graphstep: recapturing the iteration: %s", reason)
        for entry in self._graphs.values():
            entry.graph.invalidate(warmup=RECAPTURE_WARMUP)
        self._baked.clear()

    def _to_eager(self) -> None:
        for entry in self._graphs.values():
            entry.graph.close()
            entry.graph = capture.graph(self._iteration_fn(entry), backend="eager", name=self.name)
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


def _refuse_fsdp2(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("graphstep.Iteration: an FSDP2 (fully_shard) model cannot be captured yet: FSDP2 frees the "
                         "unsharded params' memory after each forward and backward and allocates it again at the "
                         "next all-gather (a storage resize, no op a graph records), so a replay would read freed "
                         "memory. Use capture='eager' (the same code, uncaptured), or capture only the optimizer "
                         "step (opt.step() with capture='graph')")


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else \
            f"a tensor of shape {list(loss.shape)}" + ("" if loss.requires_grad else " that does not require grad")
        raise TypeError(f"graphstep.Iteration: loss_fn must return the micro-batch's loss as a one-element tensor "
                        f"that requires grad (reduce it, e.g. .mean()); it returned {what}")
