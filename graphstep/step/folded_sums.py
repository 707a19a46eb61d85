"""The fold (``fold_grad_norm``, on by default), explained here: each grad's sum of squares is computed where the
grad becomes final, so the step reads the grads once, in the update, and its norm stage only adds the sums up.

Where, per domain (the dense params; the MoE expert params): on one rank (``ParamSums``) each grad buffer's rows
are cut into units of at least ``UNIT_ROWS`` rows ending where a param ends, and a unit of large params is folded
in backward by the hook of its last param to arrive (one op per unit, while the grads are in cache); the step norms
the rest. On several ranks (``ShardSums``) each bucket's shard is folded as its reduce-scatter lands: in the
step's reduce stage, or in backward with ``overlap_grad_reduce``. Both fold with the norm's own ``SumOfSquares``
in its order, so the step is bitwise the unfolded one (at extreme loss scales through graphstep/step/norm_prescale.py).

Its other parts: the host side (which units are current, grad accumulation, the listeners) is ``Fold``,
graphstep/hooks/fold.py; the hook stage "fold", graphstep/hooks/param_hooks.py; the landing in backward,
graphstep/hooks/grad_overlap.py; the norm stage over the folded sums, ``build_folded`` in
graphstep/step/stages/norm.py.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .norm_prescale import NormPrescale
from .stages.norm import ROW, SumOfSquares


class FoldedSums:
    """What both kinds of folded sums share: the fp64 vector the norm stage adds up, and the fold counts."""

    in_backward = False

    def __init__(self, slots: int, device):
        self.sums = torch.zeros(slots, dtype=torch.float64, device=device)
        self._slots = list(self.sums.unbind(0))  # 0-d views, written in place
        self.in_backward_folds = 0
        self.before_step_folds = 0

    def finish(self) -> None:
        """Device work the norm stage runs first, so that ``sums`` holds the sums of squares."""

    def rewritten(self) -> None:
        """The grads were changed in place by a write the version counters did not see, and the engine was told
        (torch's ``GradScaler.unscale_``), or the prescale changed since they were folded: no sum folded before
        it may count."""

    def use_prescale(self, prescale: NormPrescale) -> None:
        """Fold under the engine's ``NormPrescale`` (graphstep/step/norm_prescale.py): the norm stage's build."""
        for sums in self._sums():
            sums.use_prescale(prescale)

    def _sums(self) -> list[SumOfSquares]:
        return []


class ShardSums(FoldedSums):
    """Grads finished by a stage of the step (several ranks: a bucket's reduce-scatter; an expert domain
    without one: its local average): a unit per ``grad_shard`` entry, each folded by that stage into its
    slot with the norm's own ``SumOfSquares``, in the order the unfolded norm sums them (so bitwise it)."""

    def __init__(self, grads: Sequence[torch.Tensor]):
        super().__init__(len(grads), grads[0].device)
        self._units = [SumOfSquares(grad) for grad in grads]
        self.landed: set[int] = set()
        """Buckets whose reduce-scatter landed and was folded in backward (overlap); the step skips them."""

    def _sums(self) -> list[SumOfSquares]:
        return self._units

    def fold(self, unit: int) -> None:
        self._slots[unit].copy_(self._units[unit]())

    def rewritten(self) -> None:
        for bucket in self.landed:  # folded in backward; the others are folded by the step itself
            self.fold(bucket)
            self.before_step_folds += 1

    def land(self, bucket: int) -> None:
        """Fold ``bucket`` in backward, as its reduce-scatter lands (``overlap_grad_reduce``); the step then skips
        it (``take_landed``)."""
        self.fold(bucket)
        self.landed.add(bucket)
        self.in_backward_folds += 1

    def take_landed(self, bucket: int) -> bool:
        """Whether ``bucket`` was landed (reduced, averaged and folded) in backward; forgets it."""
        if bucket in self.landed:
            self.landed.discard(bucket)
            return True
        return False


# Rows per fold unit, at least: 2**20 elements (4 MiB of fp32 grads), small enough to be folded from cache
# right after backward wrote it, large enough that a model of many params folds in few ops.
UNIT_ROWS = 256
# A unit is folded in backward only when its params average at least this many elements (2 MiB of fp32
# grads): each param it waits for costs a Python hook call in backward (a few µs), and the fold pays only
# where it reads a large grad backward has just written, from cache. Units of smaller params are normed
# by the step itself, as unfolded (docs/perf-notes.md, "The norm").
HOOK_MIN_ELEMENTS = 2**19


class ParamSums(FoldedSums):
    """The dense params on one rank: each buffer's rows cut into units (the module docstring). A unit of large
    params is folded in backward by the hook of the last of its params to arrive; the others ("step rows",
    merged into one range per run of them) are normed by the step's norm stage itself. Host state per
    backward unit: the params it waits for in this backward, and whether its row norms are current (folded
    since its grads last changed)."""

    in_backward = True

    def __init__(self, layout, buffers):
        grads = buffers.grad_flat
        super().__init__(len(grads), grads[0].device)
        self.names = [f"param '{place.name}'" for place in layout.params]
        self._buffers = [SumOfSquares(grad) for grad in grads]
        self._unit_spans: list[tuple[SumOfSquares, int, int]] = []  # per backward unit: its buffer's sums, its rows
        self._unit_params: list[tuple[int, ...]] = []  # per backward unit: the params with elements in its rows
        self._units_in: list[range] = []  # per buffer: its backward units
        self._step_rows: list[tuple[SumOfSquares, int, int]] = []  # runs of rows the step norms itself
        for b, sums in enumerate(self._buffers):
            members = sorted((i for i, place in enumerate(layout.params) if place.buffer == b),
                             key=lambda i: layout.params[i].start)
            first_unit, step_from = len(self._unit_spans), None
            for first, end in _unit_cuts([layout.params[i].end for i in members], sums.rows.shape[0]):
                lo, hi = first * ROW, end * ROW
                params = tuple(i for i in members if layout.params[i].start < hi and layout.params[i].end > lo)
                if params and (end - first) * ROW >= HOOK_MIN_ELEMENTS * len(params):
                    if step_from is not None:
                        self._step_rows.append((sums, step_from, first))
                        step_from = None
                    self._unit_spans.append((sums, first, end))
                    self._unit_params.append(params)
                elif step_from is None:
                    step_from = first
            if step_from is not None:
                self._step_rows.append((sums, step_from, sums.rows.shape[0]))
            self._units_in.append(range(first_unit, len(self._unit_spans)))
        units_of: dict[int, list[int]] = {}
        for unit, params in enumerate(self._unit_params):
            for param in params:
                units_of.setdefault(param, []).append(unit)
        self.units_of = {param: tuple(units) for param, units in units_of.items()}
        """Per param of a backward unit (the params whose hooks fold): its units."""
        self.current = [False] * len(self._unit_spans)
        self._waiting = [len(params) for params in self._unit_params]  # params not yet arrived, per unit
        self._grads = grads
        self._backward_versions: list = [None] * len(grads)
        """Per grad buffer: its version counter when the last backward ended (None: no backward)."""

    def arrived(self, param: int) -> None:
        """``param``'s final grad arrived (once per backward): fold each of its units it completes."""
        for unit in self.units_of[param]:
            self._waiting[unit] -= 1
            if self._waiting[unit] == 0:
                self.fold(unit)
                self.in_backward_folds += 1

    def changed(self, param: int) -> None:
        """``param``'s grad changed after (or without) its units' fold: they are folded again before the step."""
        for unit in self.units_of[param]:
            self.current[unit] = False

    def _sums(self) -> list[SumOfSquares]:
        return self._buffers

    def fold(self, unit: int) -> None:
        sums, first, end = self._unit_spans[unit]
        sums.norm_rows(first, end)
        self.current[unit] = True

    def backward_ended(self) -> None:
        """At the end of a backward that folded: every grad is final; later writes are seen by the counters."""
        self._backward_versions = [grad._version for grad in self._grads]

    def note_writes(self) -> None:
        """Every backward unit of a buffer written in place since the last backward ended is no longer current."""
        for grad, units, version in zip(self._grads, self._units_in, self._backward_versions):
            if grad._version != version:
                self.current[units.start:units.stop] = [False] * len(units)

    def fold_stale(self) -> None:
        """Fold every backward unit that is not current (before the step, after ``note_writes``). A buffer that
        is all stale units is folded in one op, as the unfolded norm reads it."""
        for units, sums in zip(self._units_in, self._buffers):
            stale = [unit for unit in units if not self.current[unit]]
            if len(stale) > 1 and sum(self._unit_spans[u][2] - self._unit_spans[u][1] for u in stale) \
                    == sums.rows.shape[0]:
                sums.norm_rows(0, sums.rows.shape[0])
                self.current[units.start:units.stop] = [True] * len(units)
            else:
                for unit in stale:
                    self.fold(unit)
            self.before_step_folds += len(stale)

    def invalidate(self) -> None:
        self.current = [False] * len(self._unit_spans)
        self._waiting = [len(params) for params in self._unit_params]
        self._backward_versions = [None] * len(self._grads)

    def rewritten(self) -> None:
        self.current = [False] * len(self._unit_spans)

    def finish(self) -> None:
        for sums, first, end in self._step_rows:
            sums.norm_rows(first, end)
        for slot, sums in zip(self._slots, self._buffers):
            slot.copy_(sums.total())

    def out_of_date(self) -> list[str]:
        """Names of the params of every backward unit whose folded row norms differ from norms computed now
        (host reads: debug_step)."""
        # equal_nan: a NaN grad folds to a NaN norm, which is current, not a stale one.
        stale = [params for (sums, first, end), params in zip(self._unit_spans, self._unit_params)
                 if not torch.allclose(sums.row_norms_now(first, end), sums.row_norms[first:end],
                                       rtol=0.0, atol=0.0, equal_nan=True)]
        return [self.names[i] for i in sorted({i for params in stale for i in params})]


def _unit_cuts(param_ends: Sequence[int], rows: int) -> list[tuple[int, int]]:
    """A buffer's ``rows`` cut into units ``[first, end)`` of at least ``UNIT_ROWS`` rows, each ending at the
    row where a param ends (``param_ends``, in buffer order; the row a param ends inside goes to the next
    unit), the last at ``rows``."""
    cuts, first = [], 0
    for param_end in param_ends:
        end = min(param_end // ROW, rows)
        if end - first >= UNIT_ROWS:
            cuts.append((first, end))
            first = end
    if first < rows:
        cuts.append((first, rows))
    return cuts


def plan(config, layout, buffers, *, hooked: bool) -> Optional[FoldedSums]:
    """A domain's folded sums (None with ``fold_grad_norm`` off). ``hooked``: the domain's grads are final
    after backward (the dense params on one rank): ``ParamSums``, folded by hooks. Otherwise ``ShardSums``
    over the ``grad_shard`` entries, folded by the stage that finishes them."""
    if not config.fold_grad_norm:
        return None
    if hooked and layout.dp_size == 1:
        return ParamSums(layout, buffers)
    return ShardSums(buffers.grad_shard)
