"""How the step chain runs: eagerly, or captured once and replayed, with staleness handled.

The backend is decided once, at build (``OptimizerConfig.capture``): "graph" captures after the warm-up and
raises when it cannot; "auto" on CUDA checks the first step after the warm-up with ``capture.check``, captures
when it found nothing and otherwise stays eager and says why once; "eager" never captures. Before each replay
the runner checks what the capture baked in (``Stage.baked`` host values; params and buffers the user
replaced): a change means a recapture, never a silently frozen value, or an error with
``capture_invalidation="raise"``. A recapture follows one eager step, so whatever the new capture needs first is
set up outside it. With several ranks each decision is collective (graphstep/parallel/agreement.py). The runner
knows nothing of optimizers: it is given plain callables over buffers and stages.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import capture
from capture.baked import BakedValues
from capture.devices import backend_for

from ..config.warn import warn_user

logger = logging.getLogger("graphstep")

# Recapturing at this many replays in a row (no replay going through between) means a baked hyperparameter
# changes every step.
RECAPTURE_WARNING_STREAK = 3
BAKED_CHANGE = "a value baked into the captured step changed"  # how a recapture for a baked value starts
# Eager steps before each recapture: what made the step stale (a baked choice that changed, new state
# tensors) may need a compiled variant or lazy setup the old capture never ran, and none of that may run
# inside a capture. One step suffices: it runs the very step the capture will record.
RECAPTURE_WARMUP_STEPS = 1


class StepRunner:
    def __init__(self, *, step_fn: Callable[[], None], device, mode: str, warmup_steps: int, invalidation: str,
                 static_inputs: Callable[[], dict], baked_values: Callable[[], tuple],
                 eager_step_fn: Optional[Callable[[], None]] = None, agree: Optional[Callable[[bool], bool]] = None,
                 name: str = "graphstep.step",
                 stale_hint: str = "call opt.recapture() after replacing parameters or state tensors"):
        self._step_fn = step_fn
        self._eager_step_fn = eager_step_fn or step_fn  # what uncaptured steps run (e.g. with profiler ranges)
        self._static_inputs = static_inputs
        self._baked = BakedValues(baked_values)
        self._invalidation = invalidation
        self._agree = agree  # any_rank(flag) -> bool, or None on one process
        self._stale: Optional[str] = None  # why this rank's captured step must be recaptured, if it must
        self._warmup_steps = warmup_steps
        self._name, self._stale_hint = name, stale_hint
        self._steps = 0
        self._graph: Optional[capture.Graph] = None
        self._recapture_streak = 0
        self._warned_streak = False
        self.recaptures = 0
        """How many times the step was captured again after going stale."""
        self._backend, reason = backend_for(device, mode)
        self._check_first = mode == "auto" and self._backend != "eager"
        self._auto = mode == "auto"
        if reason is not None:
            logger.info("graphstep: %s", reason)
        if self._backend != "eager" and not self._check_first:
            self._graph = self._new_graph(warmup_steps)

    @property
    def captured(self) -> bool:
        return self._graph is not None and self._graph.captured

    @property
    def backend(self) -> str:
        """The backend's name (``capture.devices.backend_for``): what runs, or will run after the warm-up,
        the step."""
        return self._backend

    @property
    def may_capture(self) -> bool:
        """Whether the step is, or may yet be, captured (overlap hooks must stay off then)."""
        return self._backend != "eager"

    def _new_graph(self, warmup: int) -> "capture.Graph":
        return capture.graph(self._step_fn, warmup=warmup, backend=self._backend, static_inputs=self._static_inputs,
                             name=self._name, stale_hint=self._stale_hint)

    def pool_bytes(self) -> Optional[int]:
        """Bytes reserved in the captured step's memory pool, or None (not captured, or no pool)."""
        return None if self._graph is None else self._graph.pool_bytes()

    def invalidate(self) -> None:
        """Drop the captured step; the next step runs eagerly (``RECAPTURE_WARMUP_STEPS``), then the step is
        captured again."""
        if self._graph is not None:
            self._graph.invalidate(warmup=RECAPTURE_WARMUP_STEPS)
        self._baked.clear()

    def on_replaced(self, names: list) -> None:
        """Params or buffers were replaced and have been adopted back (values copied into the static
        tensors): a captured step recaptures at this step, or raises with ``capture_invalidation="raise"``
        (on every rank, when several share the step)."""
        if self.captured:
            self._stale = f"replaced after capture: {', '.join(names)}"

    def close(self) -> None:
        """Free the captured graph and its memory pool; later steps run eagerly."""
        if self._graph is not None:
            self._graph.close()
            self._graph = None
        self._backend = "eager"
        self._check_first = False

    def run(self) -> None:
        self._steps += 1
        if self._graph is None:
            if self._check_first and self._steps > self._warmup_steps:
                self._check_then_capture()
            else:
                self._eager_step_fn()
            return
        self._settle_staleness()
        was_captured, capturing = self._graph.captured, self._graph.capture_due
        try:
            self._graph()
        except capture.StaleInputError:
            # The engine adopts replaced tensors before each step, so this guard firing means a tensor it
            # does not own moved; recapturing over the current tensors is the only safe continuation. (With
            # several ranks, _settle_staleness has already checked the inputs and agreed on it.)
            if self._invalidation == "raise":
                raise
            logger.warning("graphstep: a static input of the captured step moved; recapturing")
            self._recapture("a static input of the captured step moved")
            was_captured = False
            self._graph()
        except Exception as error:
            if not (capturing and self._auto):
                raise  # capture="graph" promises a captured step or an error
            self._give_up_capture(error)
            return
        if not was_captured and self._graph.captured:
            self._baked.record()
            if self._agree is not None:
                self._agree(False)  # the closing bracket of the capture: no rank replays before all recorded

    def _settle_staleness(self) -> None:
        """Decide, together with the other ranks, whether the captured step must be recaptured now."""
        reason, self._stale = self._stale, None
        if reason is None and self._agree is not None:
            # Several ranks: a moved input is one more rank-local reason, decided here, before the replay.
            reason = self._graph.stale_inputs()
        if reason is None and self._graph.captured:
            changed = self._baked.change()
            if changed is not None:
                reason = f"{BAKED_CHANGE} ({changed})"
        if self._agree is not None and self._agree(reason is not None) and reason is None:
            reason = "another rank's captured step went stale"
        if reason is None:
            if self._graph.captured:  # a replay went through (not a warm-up before a recapture)
                self._recapture_streak = 0
            return
        if self._invalidation == "raise":
            raise capture.StaleInputError(
                f"{reason}; call opt.recapture() to continue (kernel='compiled' or 'reference' keeps every "
                "hyperparameter live)")
        logger.warning("graphstep: %s; recapturing", reason)
        self._recapture(reason)

    def _check_then_capture(self) -> None:
        self._check_first = False
        findings = capture.check(self._step_fn)  # runs the step once: it is this step
        # With several ranks the choice is theirs together: one rank capturing its collectives while a peer
        # runs them eagerly would pair a replay with eager calls.
        elsewhere = self._agree is not None and self._agree(bool(findings)) and not findings
        if findings or elsewhere:
            if findings:
                logger.warning("graphstep: capture='auto' keeps the step eager; it is not capturable:\n%s",
                               "\n".join(f"  {f}" for f in findings))
            else:
                logger.warning("graphstep: capture='auto' keeps the step eager: another rank's step is not "
                               "capturable (see its log)")
            self._backend = "eager"
            return
        self._graph = self._new_graph(warmup=RECAPTURE_WARMUP_STEPS)

    def _give_up_capture(self, error: Exception) -> None:
        """capture="auto" after a capture that raised: the step runs eagerly from now on, never tried again.
        This step runs eagerly now if the failed capture applied none of it (a CUDA capture only records);
        it is raised if part of it ran while recorded, or if peers captured theirs (their collectives wait
        for this rank's), since re-running it could not be made whole."""
        applied_part = self._graph.capture_runs_ops
        self.close()
        reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        if applied_part or self._agree is not None:
            logger.warning("graphstep: capture='auto' could not capture the step (%s); later steps run eagerly",
                           reason)
            raise error
        logger.warning("graphstep: capture='auto' could not capture the step (%s); it runs eagerly from now on",
                       reason)
        self._eager_step_fn()

    def _recapture(self, reason: str) -> None:
        """Capture again at the next step; warn once when that happens at every step (``reason``: why this time)."""
        self.recaptures += 1
        self._recapture_streak += 1
        self.invalidate()
        if self._recapture_streak >= RECAPTURE_WARNING_STREAK and not self._warned_streak:
            self._warned_streak = True
            if reason.startswith(BAKED_CHANGE):
                advice = ("a value it bakes in (a hyperparameter the fused kernel takes as a Python float: betas, "
                          "eps, weight decay or momentum) changes every step; kernel='compiled' or 'reference' "
                          "keeps every hyperparameter live")
            else:
                advice = ("its static inputs change every step; replace params and buffers in place (copy_) "
                          "instead of swapping tensors, or run the step eagerly (capture='eager')")
            warn_user(f"graphstep: the captured step was recaptured on each of the last {self._recapture_streak} "
                      f"replays, the last time because {reason}: {advice}", RuntimeWarning)
