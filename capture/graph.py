"""capture.graph(fn): warm up, capture once, then replay — one object per step.

    g = capture.graph(step, warmup=1, static_inputs=lambda: {"grad_flat": grad_flat})
    for batch in data:
        out = g()      # calls 1..warmup: eager; next: capture; then: replay

Every call applies fn's effects exactly once, the capture call included, on every backend. The value returned
is what fn returned at capture, as graph-owned tensors each replay updates in place: clone what you keep. Each
Graph owns its backend (its CUDA graph, pool and stream); no module- or class-level state, so several graphs
coexist and close independently.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .backends import CaptureOptions, make_backend, resolve
from .backends.eager import EagerBackend
from .errors import StaleInputError
from .guards import StaticInputGuard, StaticInputs

__all__ = ["Graph", "graph"]

_REPLACED_DURING_CAPTURE = (
    "the step replaced it while it was being captured; warm it up first (warmup >= 1) "
    "so that lazily created tensors exist before the capture"
)


class Graph:
    """A captured step. See the module docstring; build one with `capture.graph`."""

    def __init__(
        self,
        fn: Callable[[], Any],
        *,
        warmup: int = 1,
        backend: str = "auto",
        static_inputs: Optional[StaticInputs] = None,
        pool: Any = None,
        name: str = "step",
        stale_hint: Optional[str] = None,
        allow_rng: bool = False,
        device: Any = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"capture.graph needs a callable, got {type(fn).__name__}")
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
        self._fn = fn
        self._warmup_left = warmup  # eager calls still due before the next capture
        self.name = name
        self._guard = (
            StaticInputGuard(static_inputs, stale_hint=stale_hint) if static_inputs is not None else None
        )
        resolve(backend, ())  # reject unknown names before touching any device
        # Only "auto" looks at where the inputs live; otherwise the callable is first
        # evaluated at capture, so it may refer to state the warm-up creates.
        tensors = self._guard.tensors().values() if self._guard is not None and backend == "auto" else ()
        options = CaptureOptions(allow_rng=bool(allow_rng), device=device if device is not None else self._input_device)
        self._backend = make_backend(backend, tensors, pool=pool, label=name, options=options)
        self._captured = False
        self._closed = False
        self.num_calls = 0
        self.num_replays = 0

    def _input_device(self) -> Optional[torch.device]:
        """The device of the first static input (what the step runs on); None without static inputs,
        or while a static_inputs callable cannot be evaluated yet (state the warm-up creates)."""
        if self._guard is None:
            return None
        try:
            tensors = self._guard.tensors()
        except Exception:  # evaluated again at the next call; the guard reports real errors at capture
            return None
        for t in tensors.values():
            return t.device
        return None

    # -- state ---------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """"cuda" | "replay" | "eager"."""
        return self._backend.name

    @property
    def capture_due(self) -> bool:
        """Whether the next call captures (warm-up done, nothing captured yet)."""
        return (not self._closed and not self._captured and self._warmup_left == 0
                and self._backend.name != EagerBackend.name)

    @property
    def capture_runs_ops(self) -> bool:
        """Whether a capture runs the step's ops as it records them (the backend's ``capture_runs_ops``): a
        capture that raised has then applied part of the step; otherwise it applied nothing."""
        return self._backend.capture_runs_ops

    @property
    def captured(self) -> bool:
        """True once a capture has succeeded (and until invalidate() or close())."""
        return self._captured

    @property
    def closed(self) -> bool:
        return self._closed

    # -- calls ---------------------------------------------------------------------
    def __call__(self) -> Any:
        if self._closed:
            raise RuntimeError(f"graph {self.name!r} is closed")
        if self._backend.name == EagerBackend.name:  # no capture: fn on every call
            out = self._backend.warmup(self._fn)
        elif self._captured:
            if self._guard is not None:
                self._guard.verify()  # before touching any memory
            out = self._backend.replay()
            self.num_replays += 1
        elif self._warmup_left > 0:
            out = self._backend.warmup(self._fn)
            self._warmup_left -= 1
        else:
            out = self._capture()
        self.num_calls += 1
        return out

    def _capture(self) -> Any:
        if self._guard is None:
            out = self._backend.capture(self._fn)
        else:
            self._guard.record()
            out = self._backend.capture(self._fn)
            # A step that allocates its state lazily replaces static inputs during
            # its first run; captured then, the graph would hold the old tensors.
            try:
                self._guard.verify(hint=_REPLACED_DURING_CAPTURE)
            except StaleInputError:
                self._backend.reset()
                raise
        self._captured = True
        return out

    def stale_inputs(self) -> Optional[str]:
        """Why the next replay would refuse (a static input moved or changed), or None. The same check
        the replay runs first, for owners that must decide before replaying (several ranks agreeing)."""
        if not self._captured or self._guard is None:
            return None
        try:
            self._guard.verify()
        except StaleInputError as exc:
            return str(exc)
        return None

    def pool_bytes(self) -> Optional[int]:
        """Bytes reserved in the captured step's memory pool (CUDA graphs); None where there is no pool."""
        return self._backend.pool_bytes() if self._captured else None

    def invalidate(self, warmup: int = 0) -> None:
        """Drop the capture; the next ``warmup`` calls run eagerly, the one after captures anew.

        A warm-up before a recapture lets the step's lazy work (a torch.compile variant it now needs, a
        workspace) happen outside the capture."""
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
        self._warmup_left = warmup
        self._backend.reset()
        if self._guard is not None:
            self._guard.clear()
        self._captured = False

    def close(self) -> None:
        """Free the graph, pool and stream. Later calls raise. Idempotent."""
        if not self._closed:
            self._backend.close()
            self._captured = False
            self._closed = True

    def __enter__(self) -> "Graph":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("captured" if self._captured else "not captured")
        return f"<capture.Graph {self.name!r} backend={self.backend} {state} calls={self.num_calls}>"


def graph(
    fn: Callable[[], Any],
    *,
    warmup: int = 1,
    backend: str = "auto",
    static_inputs: Optional[StaticInputs] = None,
    pool: Any = None,
    name: str = "step",
    stale_hint: Optional[str] = None,
    allow_rng: bool = False,
    device: Any = None,
) -> Graph:
    """Wrap a zero-argument step `fn` (closing over static tensors) as a Graph.

    warmup:        eager calls before the capture (lazy state, allocator warm-up)
    backend:       "auto" (CUDA graph when a GPU holds the inputs, else "replay"),
                   "cuda", "replay" or "eager" (always runs fn)
    static_inputs: Mapping[str, Tensor] or zero-arg callable returning one; checked
                   before every replay, StaleInputError if any moved or changed
    pool:          CUDA graph memory pool to share (torch.cuda.graph_pool_handle())
    name:          used in messages
    stale_hint:    replaces "call invalidate() ..." at the end of StaleInputError
    allow_rng:     the step draws random numbers on purpose (the replay backend refuses RNG
                   ops otherwise; a CUDA graph replays the default CUDA generator's draws)
    device:        the device the step runs on; the CUDA backend creates its stream and graph
                   under it. Default: the first static input's device, else the current one
    """
    return Graph(
        fn, warmup=warmup, backend=backend, static_inputs=static_inputs, pool=pool, name=name,
        stale_hint=stale_hint, allow_rng=allow_rng, device=device,
    )
