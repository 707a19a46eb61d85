"""The folded grad norm (``fold_grad_norm``, on by default): each grad's sum of squares is computed where
the grad becomes final, so the step reads the grads once, in the update.

Where the fold happens, per domain (the dense params, and the MoE expert params when there are some):

- **One rank** (``ParamSums``): for every param of at least 4,096 elements, its listener on the param's
  post-accumulate-grad hook (stage "fold", graphstep/param_hooks.py: after the fp32 main grad's) computes,
  right after backward wrote the grad and while it is still in cache, the fp32 norms of the param's
  4,096-element rows: one op per param. The step's norm stage then rescues rows whose fp32 norm
  overflowed, adds the leftovers (tails under 4,096 elements and the small params: 0.1% of GPT-2 small's
  grads, gathered by a few ``cat``s into a static scratch and normed in fp64) and sums the squares in fp64,
  per grad buffer.
- **Several ranks** (``ShardSums``): the norm is of this rank's reduced shard, so each bucket's sum of
  squares is computed right after its reduce-scatter lands: in the step's reduce stage, or, with
  ``overlap_grad_reduce`` (eager), in backward, when the hook that launches the next bucket lands the
  ones launched before it (``Overlap``). An expert domain without a reduce-scatter folds right after the
  step's local average.

Exactness. With several ranks the folded units are the buckets' shards the unfolded norm reads, summed by
the same ``SumOfSquares`` in the same order: the norm, and so the step, is bitwise the unfolded one. With
one rank the rows start at each param instead of each buffer: the sum is as accurate (fp32 rows of 4,096,
fp64 tails and sums), not bitwise the same; the overflow rescue covers ``RESCUE_ROWS`` rows per grad
buffer, as unfolded.

Which sums are current (one rank). A param's folded norms are current when they were folded after its
grad last changed. The host keeps a flag per param: a fold sets it; a backward under ``no_sync()`` (an
earlier micro-batch: no fold), ``zero_grad``, a step and a broken grad binding clear it. It also keeps,
per grad buffer, the buffer's version counter as backward left it: every param's hook (folded or not)
records it after the param's grad was accumulated. Every in-place write to a grad bumps the counter of
its whole buffer (grads are views of it), so a count that moved on by the step means a grad changed after
backward (``p.grad.mul_(...)``, ``clip_grad_norm_``, a hand unscale): the buffer's params are then no
longer current. Before each step every param that is not current is folded then, as eager device work
ahead of the (captured) step: such changed grads, params without a grad in the last backward, grads
written by hand, a step with no backward. ``fold_counts`` says how many folds ran in backward and how many
before the step (none there in a loop that gets the fold's benefit). torch's ``GradScaler.unscale_``
rewrites the grads without bumping their counters (``_amp_foreach_non_finite_check_and_unscale_``), but
``scaler.step(opt)`` then tells the engine so (graphstep/torch_amp.py): every sum is folded again before
that step. Not detectable: any other write that bypasses the version counter (through ``.data``, or into
the buffer's memory by an extension or collective); ``debug_step()`` warns, naming the params, when a
folded norm no longer matches its grad.

Grad accumulation without ``no_sync()``. Every backward then folds, and only the last fold counts: one read
of the grads per micro-batch where the unfolded norm reads them once. A step that saw a param's grad
arrive twice outside ``no_sync()`` warns once and sends the next steps' fold to the step itself (before
it, as for stale params), until a step sees a single backward again.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch

from .micro_batches import NoSync
from .stages.norm import RESCUE_ROWS, ROW, RowRescue, SumOfSquares


class _Slots:
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
        (torch's ``GradScaler.unscale_``): no sum folded before it may count."""


class ShardSums(_Slots):
    """Grads finished by a stage of the step (several ranks: a bucket's reduce-scatter; an expert domain
    without one: its local average): a unit per ``grad_shard`` entry, each folded by that stage into its
    slot with the norm's own ``SumOfSquares``, in the order the unfolded norm sums them (so bitwise it)."""

    def __init__(self, grads: Sequence[torch.Tensor]):
        super().__init__(len(grads), grads[0].device)
        self._units = [SumOfSquares(grad) for grad in grads]
        self.landed: set[int] = set()
        """Buckets whose reduce-scatter landed and was folded in backward (overlap); the step skips them."""

    def fold(self, unit: int) -> None:
        self._slots[unit].copy_(self._units[unit]())

    def rewritten(self) -> None:
        for bucket in self.landed:  # folded in backward; the others are folded by the step itself
            self.fold(bucket)
            self.before_step_folds += 1

    def take_landed(self, bucket: int) -> bool:
        """Whether ``bucket`` was landed (reduced, averaged and folded) in backward; forgets it."""
        if bucket in self.landed:
            self.landed.discard(bucket)
            return True
        return False


class ParamSums(_Slots):
    """The dense params on one rank. A param of at least one 4,096-element row is folded by its
    post-accumulate-grad hook: one op on a grad still in cache, the fp32 norms of its rows, into one
    row-norm vector per grad buffer. What is left over (the tails of fewer than 4,096 elements, and the
    params smaller than a row: biases, norms' weights) is read by the norm stage itself: per buffer, a few
    ``cat``s of them into a static scratch (``_gathers``) and one fp64 norm of it (a small fraction of the
    grads: hooks and ops per small param would cost backward more than the bytes, and a foreach norm
    upcasting each piece to fp64 runs a cast and a norm per piece; docs/perf-notes.md). The stage
    ``finish``es each buffer: rows whose fp32 norm overflowed are rescued (``norm.RowRescue``), then the
    squares are summed in fp64 into the buffer's slot."""

    in_backward = True

    def __init__(self, layout, buffers):
        grads = buffers.grad_flat
        super().__init__(len(grads), grads[0].device)
        self.names = [f"param '{place.name}'" for place in layout.params]
        self._rows: dict[int, tuple] = {}  # param index -> (its rows, their norms' slice of the buffer's)
        self._buffers = []
        self._hooked_in: list[list[int]] = []  # per grad buffer: its params of at least one row
        for b, grad in enumerate(grads):
            members = sorted((i for i, place in enumerate(layout.params) if place.buffer == b),
                             key=lambda i: layout.params[i].start)
            row_counts = [(layout.params[i].end - layout.params[i].start) // ROW for i in members]
            row_norms = torch.zeros(sum(row_counts), dtype=torch.float32, device=grad.device)
            starts, tails, first = [], [], 0
            for i, rows in zip(members, row_counts):
                start, end = layout.params[i].start, layout.params[i].end
                if rows:
                    starts += range(start, start + rows * ROW, ROW)
                    self._rows[i] = (grad[start:start + rows * ROW].view(rows, ROW), row_norms[first:first + rows])
                    first += rows
                if start + rows * ROW < end:
                    tails.append(grad[start + rows * ROW:end])
            leftovers = torch.empty(sum(t.numel() for t in tails), dtype=grad.dtype, device=grad.device)
            rescue = _row_rescue(grad, row_norms, starts)
            self._buffers.append((row_norms, _gathers(tails, leftovers), leftovers, rescue))
            self._hooked_in.append([i for i, rows in zip(members, row_counts) if rows])
        self.hooked = sorted(self._rows)
        """The params folded in backward (at least one full row); the rest is read by the step."""
        self.current = dict.fromkeys(self.hooked, False)
        """Per hooked param: folded since its grad last changed (host flags)."""
        self._grads = grads
        self._buffer_of = [place.buffer for place in layout.params]
        self._backward_versions: list = [None] * len(grads)
        """Per grad buffer: its version counter as the last hook of a backward saw it (None: no backward)."""

    def fold(self, param: int) -> None:
        rows, row_norms = self._rows[param]
        torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32, out=row_norms)
        self.current[param] = True

    def saw_backward_write(self, param: int) -> None:
        """From param ``param``'s hook, after backward accumulated its grad (folded or not)."""
        buffer = self._buffer_of[param]
        self._backward_versions[buffer] = self._grads[buffer]._version

    def fold_stale(self) -> None:
        """Fold every hooked param that is not current (before the step), counting as not current every param
        of a buffer written in place since backward's last write to it."""
        for buffer, grad in enumerate(self._grads):
            if grad._version != self._backward_versions[buffer]:
                for param in self._hooked_in[buffer]:
                    self.current[param] = False
        for param, current in self.current.items():
            if not current:
                self.fold(param)
                self.before_step_folds += 1

    def invalidate(self) -> None:
        self.current = dict.fromkeys(self.hooked, False)
        self._backward_versions = [None] * len(self._grads)

    def rewritten(self) -> None:
        self.current = dict.fromkeys(self.hooked, False)

    def finish(self) -> None:
        for slot, (row_norms, gathers, leftovers, rescue) in zip(self._slots, self._buffers):
            total = None
            if gathers:
                for pieces, into in gathers:
                    torch.cat(pieces, out=into)
                total = torch.linalg.vector_norm(leftovers, dtype=torch.float64).square()
            if row_norms.numel():
                rows_total = rescue().square_().sum()
                total = rows_total if total is None else rows_total + total
            if total is None:
                slot.zero_()
            else:
                slot.copy_(total)

    def out_of_date(self) -> list[str]:
        """Names of the params whose folded row norms differ from norms computed now (host reads: debug_step)."""
        # equal_nan: a NaN grad folds to a NaN norm, which is current, not a stale one.
        return [self.names[i] for i, (rows, row_norms) in self._rows.items()
                if not torch.allclose(torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32), row_norms,
                                      rtol=0.0, atol=0.0, equal_nan=True)]


# torch's CPU ``cat`` copies its pieces with one memcpy loop when the result has fewer elements than its
# grain size (32,768), or when it runs one thread; otherwise it goes through a narrow and a copy op per
# piece (99 at GPT-2 small).
_SERIAL_CAT = 32_768


def _gathers(tails: list, leftovers: torch.Tensor) -> list[tuple[list, torch.Tensor]]:
    """``tails`` gathered into ``leftovers`` as (pieces, their slice of ``leftovers``) cats: on the CPU each
    under ``_SERIAL_CAT`` elements (one large cat costs an op per piece; docs/perf-notes.md), elsewhere one."""
    limit = _SERIAL_CAT if leftovers.device.type == "cpu" else leftovers.numel() + 1
    gathers, pieces, start, size = [], [], 0, 0
    for tail in tails:
        if pieces and size + tail.numel() >= limit:
            gathers.append((pieces, leftovers[start:start + size]))
            pieces, start, size = [], start + size, 0
        pieces.append(tail)
        size += tail.numel()
    if pieces:
        gathers.append((pieces, leftovers[start:start + size]))
    return gathers


def _row_rescue(grad: torch.Tensor, row_norms: torch.Tensor, starts: list[int]) -> RowRescue:
    """The rescue of a buffer whose rows start at ``starts`` (each param's rows begin at the param)."""
    row_starts = torch.tensor(starts, dtype=torch.int64, device=grad.device)
    offsets = torch.arange(ROW, dtype=torch.int64, device=grad.device)
    index = torch.empty(min(RESCUE_ROWS, len(starts)), ROW, dtype=torch.int64, device=grad.device)

    def fetch(picked: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        torch.add(row_starts.index_select(0, picked).unsqueeze(1), offsets, out=index)
        torch.index_select(grad, 0, index.view(-1), out=out.view(-1))
        return out

    return RowRescue(row_norms, fetch, grad.dtype)


def plan(config, layout, buffers, *, hooked: bool) -> Optional[_Slots]:
    """A domain's folded sums (None with ``fold_grad_norm`` off). ``hooked``: the domain's grads are final
    after backward (the dense params on one rank): ``ParamSums``, folded by hooks. Otherwise ``ShardSums``
    over the ``grad_shard`` entries, folded by the stage that finishes them."""
    if not config.fold_grad_norm:
        return None
    if hooked and layout.dp_size == 1:
        return ParamSums(layout, buffers)
    return ShardSums(buffers.grad_shard)


class Fold:
    """The engine's side of the fold: the one-rank listeners (stage "fold" of every dense param's grad hook,
    graphstep/param_hooks.py: it folds a param of a full row, and records its buffer's version counter for
    every param) and the host bookkeeping around a step, over every domain's folded sums. Inert without
    ``fold_grad_norm``."""

    def __init__(self, domains: Sequence[Optional[_Slots]], buffers, no_sync: NoSync, hooks):
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
        if self.hooked is None:
            return
        for index in range(len(buffers.params)):
            # Stage "fold" runs after stage "main_grad" (param_hooks.STAGES): main_grad holds the grad by then.
            hooks.listen("fold", buffers, index, self, "grad_arrived", index)

    def grad_arrived(self, index: int, param: torch.nn.Parameter) -> None:
        """Param ``index``'s listener: backward has accumulated its grad (called only while the buffers own the
        param: a later optimizer over the same model may have taken it)."""
        folded = self.hooked
        if self._no_sync.active:  # an earlier micro-batch: the grad changed, the last one folds it
            if index in folded.current:
                folded.current[index] = False
            return
        self._buffers.adopt_grad(index, param)  # before recording: adopting a fresh grad writes the buffer
        if index in folded.current:
            self._repeated |= index in self._arrived
            self._arrived.add(index)
            if self.fold_in_backward:
                folded.fold(index)
                folded.in_backward_folds += 1
            else:
                folded.current[index] = False
        folded.saw_backward_write(index)

    def forget_unbound_grads(self) -> None:
        """Before the engine re-binds grads: a folded param whose ``.grad`` is no longer its flat view (set to
        None, or assigned, after its hook ran) gets its view rewritten by the re-binding: fold it again."""
        if self.hooked is None:
            return
        for index in self.hooked.hooked:
            if not self._buffers.grad_bound(index):
                self.hooked.current[index] = False

    def fold_stale(self) -> None:
        """Right before the step: fold every param backward did not (or whose grad changed since)."""
        if self.hooked is not None:
            self.hooked.fold_stale()

    def grads_rewritten(self) -> None:
        """Before the step, ahead of ``fold_stale``: every grad was rewritten in place unseen by the version
        counters (torch's ``GradScaler.unscale_``): every folded sum is computed again."""
        for domain in self.domains:
            domain.rewritten()

    def fold_before_step(self) -> None:
        """From now on fold right before each step, never in backward: something rewrites every grad after
        backward's hooks ran (DDP's averaged grads, graphstep/ddp.py), so a fold in backward would be wasted."""
        self._rewritten_after_backward = True
        self.fold_in_backward = False

    def invalidate(self) -> None:
        """After ``zero_grad`` (and a step): the next backward must fold again."""
        if self.hooked is not None:
            self.hooked.invalidate()
        self._arrived.clear()
        self._repeated = False

    def after_step(self, stacklevel: int) -> None:
        """Invalidate, and decide where the next step's fold runs: in backward, unless this step's grads were
        accumulated over several backwards outside ``no_sync()`` (folding in each costs a read of the grads
        per backward; folding before the step, one). ``stacklevel``: the warning's, from here to the user's
        call."""
        if self._repeated and self.fold_in_backward and not self._warned:
            self._warned = True
            warnings.warn("graphstep: fold_grad_norm: backward ran more than once outside opt.no_sync() between "
                          "steps (grad accumulation), and each folded the norm again. While steps see that, the "
                          "norm is folded right before the step instead (one read of the grads, as with "
                          "fold_grad_norm=False). Run the earlier micro-batches under opt.no_sync() to fold in "
                          "the last backward only", RuntimeWarning, stacklevel=stacklevel)
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
            shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
            warnings.warn(f"graphstep: fold_grad_norm: the folded norm of {shown} no longer matches the grad: "
                          "it changed after backward folded it, by a write that bypassed its version counter "
                          "(through .data, or by an extension). The step's norm uses the stale one; change "
                          "grads in place through the grad itself, or turn fold_grad_norm off",
                          RuntimeWarning, stacklevel=3)

    def remove(self) -> None:
        self._hooks.remove(self)
