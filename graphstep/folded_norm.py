"""The folded grad norm (``fold_grad_norm=True``): each grad's sum of squares is computed where the grad
becomes final, so the step reads the grads once, in the update (issue 18).

Where the fold happens, per domain (the dense params, and the MoE expert params when there are some):

- **One rank**: a post-accumulate-grad hook on every param computes the sum of squares of the param's
  grad (its range of the flat grad buffer) right after backward wrote it, while it is still in cache.
- **Several ranks**: the norm is of this rank's reduced shard, so each bucket's sum of squares is
  computed right after its reduce-scatter lands: in the step's reduce stage, or, with
  ``overlap_grad_reduce`` (eager), in backward, when the hook that launches the next bucket lands the
  ones launched before it (``Overlap``). An expert domain without a reduce-scatter folds right after the
  step's local average.

Every fold writes one fp64 slot of ``FoldedSums.sums`` (the norm's ``SumOfSquares`` over the unit: rows of
4,096, fp64 tail, overflow rescue); the step's norm stage only sums that vector. With several ranks the
units are the buckets' shards the unfolded norm reads, in the same order: the result is bitwise the
unfolded one. With one rank the rows start at each param instead of each buffer: the sum is as accurate
(fp64 over fp32 rows), not bitwise the same.

Which slots are current (one rank). A slot is current when it was folded after its grad last changed. The
host keeps a flag per param: a fold sets it; a backward under ``no_sync()`` (an earlier micro-batch: no
fold), ``zero_grad``, a step and a broken grad binding clear it. Before each step every slot that is not
current is folded then, as eager device work ahead of the (captured) step: params without a grad in the
last backward, grads written by hand, a step with no backward. ``fold_counts`` says how many folds ran in
backward and how many before the step (none there in a loop that gets the fold's benefit). Not
detectable: a grad changed in place after its hook ran (``p.grad.mul_(...)`` after backward, a hand-made
all-reduce). With the fold on, change grads only through backward; ``debug_step()`` warns, naming the
params, when a folded sum no longer matches its grad.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Optional, Sequence

import torch

from .stages.norm import SumOfSquares


class FoldedSums:
    """One domain's folded sums of squares: a static fp64 slot per unit (a param with one rank, a bucket's
    shard with several, a grad buffer for an expert domain averaged in the step)."""

    def __init__(self, grads: Sequence[torch.Tensor], names: Sequence[str], *, in_backward: bool):
        self.in_backward = in_backward
        """Folded by backward hooks (one rank), so slots may be stale at a step; else folded by the step's
        own reduce or average stage, which runs before the norm."""
        self.names = list(names)
        self._units = [SumOfSquares(grad.reshape(-1)) for grad in grads]
        device = grads[0].device if grads else torch.device("cpu")
        self.sums = torch.zeros(len(self._units), dtype=torch.float64, device=device)
        self._slots = list(self.sums.unbind(0))  # 0-d views: each fold writes its slot in place
        self.current = [False] * len(self._units)
        self.landed: set[int] = set()
        """Buckets whose reduce-scatter landed and was folded in backward (overlap); the step skips them."""
        self.in_backward_folds = 0
        self.before_step_folds = 0

    def fold(self, unit: int) -> None:
        self._slots[unit].copy_(self._units[unit]())
        self.current[unit] = True

    def fold_stale(self) -> None:
        """Fold every slot that is not current (one rank: before the step)."""
        for unit, current in enumerate(self.current):
            if not current:
                self.fold(unit)
                self.before_step_folds += 1

    def invalidate(self) -> None:
        self.current = [False] * len(self._units)

    def take_landed(self, bucket: int) -> bool:
        """Whether ``bucket`` was landed (reduced, averaged and folded) in backward; forgets it."""
        if bucket in self.landed:
            self.landed.discard(bucket)
            return True
        return False

    def out_of_date(self) -> list[str]:
        """Names of the units whose slot differs from a sum computed now (host reads: for debug_step)."""
        return [name for name, unit, slot in zip(self.names, self._units, self._slots)
                if not torch.equal(unit(), slot)]


def plan(config, layout, buffers, *, hooked: bool) -> Optional[FoldedSums]:
    """A domain's ``FoldedSums`` (None with ``fold_grad_norm`` off). ``hooked``: the domain's grads are final
    after backward (the dense params on one rank): one unit per param, folded by hooks. Otherwise one unit
    per ``grad_shard`` entry, folded by the stage that finishes it (reduce-scatter or local average)."""
    if not config.fold_grad_norm:
        return None
    if hooked and layout.dp_size == 1:
        return FoldedSums([buffers.grad_view(i) for i in range(len(layout.params))],
                          [f"param '{place.name}'" for place in layout.params], in_backward=True)
    names = ([f"bucket {b.index}" for b in layout.buckets] if layout.dp_size > 1
             else [f"grad buffer {b}" for b in range(len(buffers.grad_shard))])
    return FoldedSums(buffers.grad_shard, names, in_backward=False)


class Fold:
    """The engine's side of the fold: the one-rank hooks (a post-accumulate-grad hook per param) and the host
    bookkeeping around a step, over every domain's ``FoldedSums``. Inert without ``fold_grad_norm``."""

    def __init__(self, domains: Sequence[Optional[FoldedSums]], buffers):
        self.domains = [d for d in domains if d is not None]
        hooked = [d for d in self.domains if d.in_backward]
        self.hooked = hooked[0] if hooked else None  # the dense domain on one rank
        self._handles = []
        self._no_sync = False
        if self.hooked is None:
            return
        for index, param in enumerate(buffers.params):
            # Registered after buffers' main-grad hook (allocate), so it runs once main_grad holds the grad.
            self._handles.append(param.register_post_accumulate_grad_hook(self._hook(index, buffers)))

    def _hook(self, index: int, buffers):
        folded = self.hooked

        def hook(param: torch.nn.Parameter) -> None:
            if self._no_sync:  # an earlier micro-batch: the grad changed, the last one folds it
                folded.current[index] = False
                return
            buffers.adopt_grad(index, param)
            folded.fold(index)
            folded.in_backward_folds += 1

        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate: their grads are folded by the last micro-batch's backward."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def before_step(self, grads_rebound: bool) -> None:
        """Fold what is not current; ``grads_rebound``: the engine re-bound grads (set to None, replaced), so
        no fold from backward can be trusted."""
        if self.hooked is None:
            return
        if grads_rebound:
            self.hooked.invalidate()
        self.hooked.fold_stale()

    def invalidate(self) -> None:
        """After a step or ``zero_grad``: the next backward must fold again."""
        if self.hooked is not None:
            self.hooked.invalidate()

    def counts(self) -> dict[str, int]:
        """Folds run in backward (hooks, or buckets landed there) and right before the step (stale slots)."""
        return {"in_backward": sum(d.in_backward_folds for d in self.domains),
                "before_step": sum(d.before_step_folds for d in self.domains)}

    def warn_out_of_date(self) -> None:
        """debug_step's check: warn naming every param whose folded sum no longer matches its grad. (Only
        hook-folded sums can be out of date here: the others are folded by the step itself.)"""
        stale = self.hooked.out_of_date() if self.hooked is not None else []
        if stale:
            shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
            warnings.warn(f"graphstep: fold_grad_norm: the folded sum of squares of {shown} no longer matches "
                          "the grad: it changed after backward folded it (an in-place change to .grad). The "
                          "step's norm uses the stale sum; change grads only through backward, or turn "
                          "fold_grad_norm off", RuntimeWarning, stacklevel=3)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
