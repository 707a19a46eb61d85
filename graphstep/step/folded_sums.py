"""The folded grad norm (``fold_grad_norm``, on by default): each grad's sum of squares is computed where
the grad becomes final, so the step reads the grads once, in the update.

Where the fold happens, per domain (the dense params, and the MoE expert params when there are some):

- **One rank** (``ParamSums``): for every param of at least 4,096 elements, its listener on the param's
  post-accumulate-grad hook (stage "fold", graphstep/hooks/param_hooks.py: after the fp32 main grad's) computes,
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

The host bookkeeping around them (which sums are current, grad accumulation) is graphstep/hooks/fold.py.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .stages.norm import RESCUE_ROWS, ROW, RowRescue, SumOfSquares


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
        (torch's ``GradScaler.unscale_``): no sum folded before it may count."""


class ShardSums(FoldedSums):
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


class ParamSums(FoldedSums):
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


def plan(config, layout, buffers, *, hooked: bool) -> Optional[FoldedSums]:
    """A domain's folded sums (None with ``fold_grad_norm`` off). ``hooked``: the domain's grads are final
    after backward (the dense params on one rank): ``ParamSums``, folded by hooks. Otherwise ``ShardSums``
    over the ``grad_shard`` entries, folded by the stage that finishes them."""
    if not config.fold_grad_norm:
        return None
    if hooked and layout.dp_size == 1:
        return ParamSums(layout, buffers)
    return ShardSums(buffers.grad_shard)
