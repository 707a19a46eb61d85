"""The fold's listeners and host bookkeeping (the sums themselves: graphstep/step/folded_sums.py).

The host keeps, per unit of rows, whether its folded norms are current: a fold sets the flag; ``no_sync()``,
a grad arriving twice, ``zero_grad``, a step or a broken grad binding clear it. Grads are views of one buffer,
so any in-place write to a grad bumps the buffer's version counter; a counter that moved on after backward
means a grad changed, and its units are folded again before the step (eager device work, ahead of the captured
step). ``GradScaler.unscale_`` bumps no counter, but ``scaler.step(opt)`` tells the engine
(graphstep/step/torch_amp.py). Writes through ``.data`` or raw memory cannot be seen: ``debug_step()`` warns.
Accumulating without ``no_sync()`` would read the grads twice, so it warns once and folds at the step instead.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..config.listing import listed
from ..config.warn import warn_user
from ..step.folded_sums import FoldedSums
from .micro_batches import NoSync


class Fold:
    """The engine's side of the fold: the one-rank listeners (stage "fold" of every dense param's grad hook,
    graphstep/hooks/param_hooks.py: it folds a param of a full row, and records its buffer's version counter for
    every param) and the host bookkeeping around a step, over every domain's folded sums. Inert without
    ``fold_grad_norm``."""

    def __init__(self, domains: Sequence[Optional[FoldedSums]], buffers, no_sync: NoSync, hooks):
        self.domains = [d for d in domains if d is not None]
        hooked = [d for d in self.domains if d.in_backward]
        self.hooked = hooked[0] if hooked else None  # the dense domain on one rank
        self._buffers = buffers
        self._hooks = hooks
        self._no_sync = no_sync
        self.fold_in_backward = True
        """False after a step whose grads were accumulated over several backwards outside ``no_sync()``: each
        of those would fold again, so the hooks leave the fold to the step until a step sees one backward."""
        self._arrived: set[int] = set()  # hooked params a backward delivered since the grads were zeroed/stepped
        self._repeated = False  # one of them was delivered again: unmarked accumulation
        self._rewritten_after_backward = False  # DDP writes the averaged grads after the hooks: fold at the step
        self._warned = False
        self._end_queued = False  # this backward's end-of-backward callback is queued
        if self.hooked is None:
            return
        for index in self.hooked.units_of:  # only the params of units folded in backward pay for a hook
            # Stage "fold" runs after stage "main_grad" (param_hooks.STAGES): main_grad holds the grad by then.
            hooks.listen("fold", buffers, index, self, "grad_arrived", index)

    def grad_arrived(self, index: int, param: torch.nn.Parameter) -> None:
        """Param ``index``'s listener: backward has accumulated its grad (called only while the buffers own the
        param: a later optimizer over the same model may have taken it)."""
        folded = self.hooked
        if self._no_sync.active:  # an earlier micro-batch: the grad changed, the last one folds it
            folded.changed(index)
            return
        self._buffers.adopt_grad(index, param)  # adopting a fresh grad writes the buffer: before the fold
        repeated = index in self._arrived
        self._repeated |= repeated
        self._arrived.add(index)
        if self.fold_in_backward and not repeated:
            folded.arrived(index)
        else:  # its units were folded (or are waiting) with an earlier grad: fold them before the step
            folded.changed(index)
        if not self._end_queued:  # params without a hook may still accumulate: record the counters at the end
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._end_queued = False
        self.hooked.backward_ended()

    def forget_unbound_grads(self) -> None:
        """Before the engine re-binds grads (when a binding broke): a folded param whose ``.grad`` is no longer
        its flat view (set to None, or assigned, after its hook ran) gets its view rewritten by the
        re-binding: fold its units again."""
        if self.hooked is None:
            return
        for index in self.hooked.units_of:
            if not self._buffers.grad_bound(index):
                self.hooked.changed(index)

    def note_writes(self) -> None:
        """Before the step, ahead of any write of the engine's own (re-binding grads): units of buffers written
        since backward ended are stale."""
        if self.hooked is not None:
            self.hooked.note_writes()

    def fold_stale(self) -> None:
        """Right before the step: fold every unit backward did not (or whose grads changed since)."""
        if self.hooked is not None:
            self.hooked.fold_stale()

    def grads_rewritten(self) -> None:
        """Before the step, ahead of ``fold_stale``: every grad was rewritten in place unseen by the version
        counters (torch's ``GradScaler.unscale_``): every folded sum is computed again."""
        for domain in self.domains:
            domain.rewritten()

    def fold_before_step(self) -> None:
        """From now on fold right before each step, never in backward: something rewrites every grad after
        backward's hooks ran (DDP's averaged grads, graphstep/hooks/ddp.py), so a fold in backward would be wasted."""
        self._rewritten_after_backward = True
        self.fold_in_backward = False

    def invalidate(self) -> None:
        """After ``zero_grad`` (and a step): the next backward must fold again."""
        if self.hooked is not None:
            self.hooked.invalidate()
        self._end_queued = False  # a backward that raised never ran its callback: queue one next time
        self._arrived.clear()
        self._repeated = False

    def after_step(self) -> None:
        """Invalidate, and decide where the next step's fold runs: in backward, unless this step's grads were
        accumulated over several backwards outside ``no_sync()`` (the first one's fold is then wasted: the
        grads are read again before the step)."""
        if self._repeated and self.fold_in_backward and not self._warned:
            self._warned = True
            warn_user("graphstep: fold_grad_norm: backward ran more than once outside opt.no_sync() between "
                      "steps (grad accumulation), so the norm folded in the first was folded again before the "
                      "step. While steps see that, the norm is folded right before the step instead (one read of "
                      "the grads, as with "
                      "fold_grad_norm=False). Run the earlier micro-batches under opt.no_sync() to fold in "
                      "the last backward only", RuntimeWarning)
        self.fold_in_backward = not (self._repeated or self._rewritten_after_backward)
        self.invalidate()

    def counts(self) -> dict[str, int]:
        """Folds run in backward (hooks, or buckets landed there) and right before the step (stale slots)."""
        return {"in_backward": sum(d.in_backward_folds for d in self.domains),
                "before_step": sum(d.before_step_folds for d in self.domains)}

    def warn_out_of_date(self) -> None:
        """debug_step's check: warn naming every param whose folded row norms no longer match its grad. (Only
        hook-folded norms can be out of date here: the others are folded by the step itself.)"""
        stale = self.hooked.out_of_date() if self.hooked is not None else []
        if stale:
            warn_user(f"graphstep: fold_grad_norm: the folded norm of {listed(stale, 5)} no longer matches the "
                      "grad: it changed after backward folded it, by a write that bypassed its version counter "
                      "(through .data, or by an extension). The step's norm uses the stale one; change grads in "
                      "place through the grad itself, or turn fold_grad_norm off", RuntimeWarning)

    def remove(self) -> None:
        self._hooks.remove(self)
