"""How the step chain runs: eagerly, or captured once and replayed, with staleness handled.

``OptimizerConfig.capture``:
- "graph": capture after ``capture_warmup_steps`` eager steps (a CUDA graph on CUDA, capture's CPU
  replay backend elsewhere); a step that cannot be captured raises ``capture.CaptureError``.
- "auto": on CUDA, the first step after the warm-up runs under ``capture.check`` (it *is* that step);
  with no findings the next step is captured, otherwise the step stays eager and says why once. Off
  CUDA it runs eagerly and says why once.
- "eager": the chain runs eagerly every step; ``opt.debug_step()`` runs it stage by stage with stats.

A captured step goes stale when what it baked in changes. Before each replay the runner checks:
- the hyperparameters the kernel takes as Python floats (see ``kernels.LIVE_FIELDS``): a change means
  a recapture (and a warning when that happens step after step), never a silently frozen value;
- params and buffers: one whose tensor was replaced (``p.data = new``, a state tensor assigned) is
  adopted back, its values copied into the static tensor, before the step runs (the engine does this in
  every mode), and a captured step recaptures; capture's own guard checks the buffers' addresses
  before each replay as a last line of defence.
With ``capture_invalidation="raise"`` both raise instead.
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable, Optional

import capture

from .hyperparams import FIELDS

logger = logging.getLogger("graphstep")

# Recapturing this many steps in a row means a baked hyperparameter changes every step.
RECAPTURE_WARNING_STREAK = 3


class StepRunner:
    def __init__(self, *, step_fn: Callable[[], None], mode: str, device, warmup_steps: int, invalidation: str,
                 static_inputs: Callable[[], dict], baked_values: Callable[[], tuple],
                 eager_step_fn: Optional[Callable[[], None]] = None):
        self._step_fn = step_fn
        self._eager_step_fn = eager_step_fn or step_fn  # what uncaptured steps run (e.g. with profiler ranges)
        self._static_inputs = static_inputs
        self._baked_values = baked_values
        self._invalidation = invalidation
        self._warmup_steps = warmup_steps
        self._device_type = device.type
        self._steps = 0
        self._graph: Optional[capture.Graph] = None
        self._baked_at_capture: Optional[tuple] = None
        self._recapture_streak = 0
        self._warned_streak = False
        self.recaptures = 0
        """How many times the step was captured again after going stale."""
        self.mode = mode
        if mode == "graph":
            self._graph = self._new_graph(warmup_steps)
        elif mode == "auto" and self._device_type != "cuda":
            logger.info("graphstep: capture='auto' runs the step eagerly on %s: CUDA graphs need a GPU "
                        "(capture='graph' uses the CPU replay backend)", self._device_type)
            self.mode = "eager"

    @property
    def captured(self) -> bool:
        return self._graph is not None and self._graph.captured

    @property
    def backend(self) -> str:
        return "eager" if self._graph is None else self._graph.backend

    def _new_graph(self, warmup: int) -> "capture.Graph":
        backend = "cuda" if self._device_type == "cuda" else "replay"
        return capture.graph(self._step_fn, warmup=warmup, backend=backend, static_inputs=self._static_inputs,
                             name="graphstep.step",
                             stale_hint="call opt.recapture() after replacing parameters or state tensors")

    def invalidate(self) -> None:
        """Drop the captured step; the next step captures it again (no new warm-up)."""
        if self._graph is not None:
            self._graph.invalidate()

    def on_replaced(self, names: list) -> None:
        """Params or buffers were replaced and have been adopted back (values copied into the static
        tensors): a captured step recaptures, or raises with ``capture_invalidation="raise"``."""
        if not self.captured:
            return
        if self._invalidation == "raise":
            raise capture.StaleInputError(
                f"replaced after capture: {', '.join(names)}; the captured step reads the static buffers. "
                "Their values were copied back in; call opt.recapture() to continue")
        logger.warning("graphstep: %s replaced after capture; adopted back, recapturing", ", ".join(names))
        self._count_recapture()
        self._graph.invalidate()

    def close(self) -> None:
        if self._graph is not None:
            self._graph.close()
            self._graph = None

    def run(self) -> None:
        self._steps += 1
        if self.mode == "auto" and self._graph is None:
            self._run_auto()
            return
        if self._graph is None:
            self._eager_step_fn()
            return
        self._check_baked()
        was_captured = self._graph.captured
        baked = self._baked_values()
        try:
            self._graph()
        except capture.StaleInputError:
            # The engine adopts replaced tensors before each step, so this guard firing means a tensor it
            # does not own moved; recapturing over the current tensors is the only safe continuation.
            if self._invalidation == "raise":
                raise
            logger.warning("graphstep: a static input of the captured step moved; recapturing")
            self._count_recapture()
            self._graph.invalidate()
            self._graph()
        if not was_captured and self._graph.captured:
            self._baked_at_capture = baked

    def _run_auto(self) -> None:
        if self._steps <= self._warmup_steps:
            self._eager_step_fn()
            return
        findings = capture.check(self._step_fn)  # runs the step once: it is this step
        if findings:
            logger.warning("graphstep: capture='auto' keeps the step eager; it is not capturable:\n%s",
                           "\n".join(f"  {f}" for f in findings))
            self.mode = "eager"
            return
        self._graph = self._new_graph(warmup=0)

    def _check_baked(self) -> None:
        if not self._graph.captured or self._baked_at_capture is None:
            return
        now = self._baked_values()
        if now == self._baked_at_capture:
            self._recapture_streak = 0
            return
        changed = _describe_change(self._baked_at_capture, now)
        if self._invalidation == "raise":
            raise capture.CaptureError(f"a hyperparameter baked into the captured step changed ({changed}); "
                                           "call opt.recapture(), or use kernel='reference' to keep it live")
        self._count_recapture()
        self._graph.invalidate()

    def _count_recapture(self) -> None:
        self.recaptures += 1
        self._recapture_streak += 1
        if self._recapture_streak >= RECAPTURE_WARNING_STREAK and not self._warned_streak:
            self._warned_streak = True
            warnings.warn("graphstep: the captured step was recaptured on each of the last "
                          f"{self._recapture_streak} steps because a hyperparameter the fused kernel takes as a "
                          "Python float (betas, eps, weight decay or momentum) changes every step; "
                          "kernel='reference' keeps every hyperparameter live", RuntimeWarning, stacklevel=4)


def _describe_change(before: tuple, after: tuple) -> str:
    """'group 0 weight_decay 0.1 -> 0.2' for the first differing baked value (group None: step-wide)."""
    for (group, field, old), (_, _, new) in zip(before, after):
        if old != new:
            where = "step" if group is None else f"group {group}"
            return f"{where} {field} {old!r} -> {new!r}"
    return "the baked values"


def baked_values(hyper, live_fields: frozenset, used_fields: tuple) -> tuple:
    """(group, field, value) of every hyperparameter the kernel reads as a float."""
    baked = []
    for group in range(hyper.num_groups):
        for field in used_fields:
            if field not in live_fields:
                baked.append((group, field, hyper.host[group][FIELDS.index(field)]))
    return tuple(baked)
