"""Non-finite check and global grad norm in one read of the (still loss-scaled) grads.

No pass unscales the grads: the scaled norm times 1/scale is the unscaled one, and the unscale is folded into
the update's grad scale (stages/clip.py). A non-finite grad makes the sum of squares non-finite, which is the
non-finite check, and the SUM all-reduce carries it to every rank, so all ranks decide the skip alike. A buffer
whose params another rank counts (graphstep/plan/model_parallel.py) adds nothing but still carries a non-finite
value. One fp32 reduction over a whole buffer is inaccurate at scale (docs/perf-notes.md, "The norm"), so the
norm is two-level: fp32 norms of 4,096-element rows, their squares summed in fp64, which also keeps a large
finite norm finite. Up to ``RESCUE_ROWS`` rows whose own fp32 norm overflowed are recomputed scaled, picked by a
fixed-size top-k so the ops never depend on the data; beyond that the step counts as non-finite. Under extreme
loss scales the rows are normed prescaled (graphstep/step/norm_prescale.py).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

# The one op every row's norm is computed by, whole buffers or a range of rows at a time (the folded norm's
# units), so both give the same bits.
from ...kernels.row_norms import row_norms
from .. import compiled_scalar_math
from ..compiled_scalar_math import scalar
from ..norm_prescale import FromScale, NormPrescale
from . import Stage, StepTensors

# Row length of the two-level sum of squares: as accurate as an fp64 sum and as fast as one dot. Every
# buffer is cut into rows of exactly ROW and a tail of fewer than ROW elements (summed in fp64): shorter
# rows that divide the buffer exactly cost time, not accuracy (docs/perf-notes.md, "The norm").
ROW = 4096
# Rows whose fp32 norm overflowed, recomputed scaled, per buffer. Few on purpose: 4 x 4,096 elements stay
# under torch's CPU grain size (32,768), so the rescue's copy, scale and norm run on the calling thread
# instead of waiting for a second one on a busy machine (docs/perf-notes.md). More overflowing rows than
# this make the step non-finite: skipped, and a dynamic loss scale backs off.
RESCUE_ROWS = 4
_DOWN = 2.0 ** -64
_UP = 2.0 ** 64


class RowRescue:
    """fp64 copies of a vector of fp32 row norms, rows whose fp32 norm overflowed recomputed scaled by 2**-64:
    up to ``RESCUE_ROWS`` of them, picked by a fixed-size top-k (the same ops whatever the grads hold).
    ``fetch(picked, out)`` gathers the picked rows (``ROW`` elements each) into ``out`` and returns it."""

    def __init__(self, row_norms: torch.Tensor, fetch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 dtype: torch.dtype):
        # Every intermediate the size of the row count or of the rescued rows lives in a buffer allocated
        # here, once: a fresh ~1 MB temporary per step is an mmap and its page faults, which on a busy
        # machine cost more than the read itself (docs/perf-notes.md).
        count, device = row_norms.numel(), row_norms.device
        self.row_norms = row_norms
        self.fetch = fetch
        self.rescue = min(RESCUE_ROWS, count)
        self.norms = torch.empty(count, dtype=torch.float64, device=device)
        self.picked_rows = torch.empty(self.rescue, ROW, dtype=dtype, device=device)

    def __call__(self, down=_DOWN, up=_UP) -> torch.Tensor:
        """``down``, ``up``: what a picked row is scaled by, and its fp64 norm after: 2**-64 and 2**64, or where
        the row norms were taken of prescaled grads the prescale row's ``rescue_down`` and ``rescue_up``
        (graphstep/step/norm_prescale.py), which also prescale the row (read as it is: multiplied back)."""
        norms = self.norms
        norms.copy_(self.row_norms)
        # The largest row norms: every overflowed one (inf) when there are at most ``rescue`` of them. A row
        # holding a NaN sorts above them in top-k and stays NaN. Picking from the norms themselves, not from
        # an isinf mask, spares two passes over the row count.
        picked = torch.topk(self.row_norms, self.rescue, sorted=False).indices
        picked_norms = norms.index_select(0, picked)
        rows = self.fetch(picked, self.picked_rows).mul_(down)
        scaled = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32)
        rescued = torch.where(torch.isinf(picked_norms), scaled.to(torch.float64) * up, picked_norms)
        return norms.index_copy_(0, picked, rescued)


class SumOfSquares:
    """fp64 0-d sum of squares of one flat grad buffer: one read, no copy, accurate at any length. The folded
    norm (graphstep/step/folded_sums.py) fills ``row_norms`` a range of ``rows`` at a time (``norm_rows``, the
    same op) and then calls ``total``: the sum is bitwise the same.

    With a ``NormPrescale`` (``use_prescale``: an engine a loss scale reaches) the row norms are taken of the
    grads divided by its power of two and the sum is of those grads (graphstep/step/norm_prescale.py)."""

    def __init__(self, grad: torch.Tensor):
        n = grad.numel()
        body = n - n % ROW
        self.rows = grad[:body].view(-1, ROW)
        self.tail = grad[body:]
        self.row_norms = torch.empty(self.rows.shape[0], dtype=torch.float32, device=grad.device)
        self._rescue = RowRescue(self.row_norms, lambda picked, out: torch.index_select(self.rows, 0, picked, out=out),
                                 grad.dtype)
        self._prescale: Optional[NormPrescale] = None
        # fp16 grads are never divided: their squares always fit fp32 (norm_prescale.py).
        self._divides = grad.dtype != torch.float16
        self._spans: dict[tuple[int, int], tuple] = {}  # (first, end): rows, their norms, the divider or None

    def use_prescale(self, prescale: Optional[NormPrescale]) -> None:
        self._prescale = prescale
        self._spans.clear()

    def norm_rows(self, first: int, end: int) -> None:
        """``row_norms[first:end]`` of ``rows[first:end]`` (``row_norms``), prescaled where a loss scale is."""
        span = self._spans.get((first, end))
        if span is None:  # views made once per span: a slice is an op
            rows = self.rows[first:end]
            divides = self._prescale is not None and self._divides
            span = self._spans[first, end] = (rows, self.row_norms[first:end],
                                              self._prescale.divider(rows) if divides else None)
        rows, out, divider = span
        if divider is None:
            row_norms(rows, out)
        else:
            divider.around(lambda: row_norms(rows, out))

    def row_norms_now(self, first: int, end: int) -> torch.Tensor:
        """The norms ``norm_rows(first, end)`` would write, computed afresh without writing the grads (a host
        check: debug_step's)."""
        rows = self.rows[first:end]
        if self._prescale is not None and self._divides and self._prescale.active():
            rows = rows / self._prescale.prescale  # the fused division's rounding: exact, or one rounding
        norms = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        row_norms(rows, norms)
        return norms

    def total(self) -> torch.Tensor:
        """The sum of squares from the row norms as they stand (overflowed rows rescued) and the tail."""
        prescale = self._prescale if self._prescale is not None and self._prescale.active() else None
        total = torch.zeros((), dtype=torch.float64, device=self.row_norms.device)
        if self.rows.shape[0]:
            if prescale is None:
                norms = self._rescue()
            elif self._divides:
                norms = self._rescue(prescale.rescue_down, prescale.rescue_up)
            else:  # fp16 rows, normed as they are: their norms prescaled in fp64, exactly
                norms = self._rescue().mul_(prescale.restore)
            total = norms.square_().sum()
        if self.tail.numel():
            tail = torch.linalg.vector_norm(self.tail, dtype=torch.float64)
            if prescale is not None:
                tail = tail * prescale.restore  # fp64: exact, the norm of the prescaled tail
            total = total + tail.square()
        return total

    def __call__(self) -> torch.Tensor:
        if self.rows.shape[0]:
            self.norm_rows(0, self.rows.shape[0])
        return self.total()


class ForeachSumOfSquares:
    """fp64 0-d sum of squares of a list of separate grad tensors (``graphstep.wrap``'s grads)."""

    def __init__(self, grads: Sequence[torch.Tensor]):
        self.grads = list(grads)

    def __call__(self) -> torch.Tensor:
        norms = torch.stack(torch._foreach_norm(self.grads, 2)).to(torch.float64)
        return norms.square().sum()


def build_over(sums: Sequence[Callable[[], torch.Tensor]], t: StepTensors, comm, compiled: bool = False,
               counted: Optional[Sequence[bool]] = None, prescale: Optional[NormPrescale] = None,
               torch_amp=None) -> Stage:
    """The norm stage over ``sums`` (each returns an fp64 0-d sum of squares of its grads); ``compiled``: as in
    ``_stage``. ``counted``: per sum, whether it counts in the norm on this rank (default: all; see
    ``CountedSum``). ``prescale``, ``torch_amp``: as in ``_stage``."""
    counted_sum = CountedSum(len(sums), counted, t.found_inf.device)

    def total() -> torch.Tensor:
        parts = [sum_of_squares() for sum_of_squares in sums]
        if counted_sum.all:
            return parts[0] if len(parts) == 1 else torch.stack(parts).sum()
        return counted_sum(torch.stack(parts))

    return _stage(total, t, comm, compiled, prescale, torch_amp)


class CountedSum:
    """The sum of a vector of sums of squares of which only some count in the norm on this rank (the others
    another rank counts: graphstep/plan/model_parallel.py). A left-out sum adds 0, or NaN when it is not
    finite (0 · inf), so a non-finite grad in it still skips the step on every rank."""

    def __init__(self, size: int, counted: Optional[Sequence[bool]], device):
        counted = [True] * size if counted is None else list(counted)
        if len(counted) != size:
            raise ValueError(f"norm: {size} sums of squares but {len(counted)} counted flags")
        self.all = all(counted)
        self._keep = torch.tensor([i for i, c in enumerate(counted) if c], dtype=torch.int64, device=device)
        self._drop = torch.tensor([i for i, c in enumerate(counted) if not c], dtype=torch.int64, device=device)

    def __call__(self, sums: torch.Tensor) -> torch.Tensor:
        return sums.index_select(0, self._keep).sum() + sums.index_select(0, self._drop).sum() * 0.0


def build_folded(folds: Sequence, t: StepTensors, comm, compiled: bool = False,
                 counted: Optional[Sequence[bool]] = None, prescale: Optional[NormPrescale] = None,
                 torch_amp=None) -> Stage:
    """The norm stage over sums of squares already folded where the grads became final (graphstep.step.folded_sums):
    it reads no grad. Each domain ``finish``es its fp64 vector (one rank: rescue and sum the folded row
    norms), then the vectors are summed as one: with several ranks the same values in the same order as
    ``build_over``'s parts, summed the same way. ``counted``: per slot of the joined vector (one per
    ``grad_shard`` entry), as in ``build_over``; ``prescale``, ``torch_amp``: as in ``_stage``."""
    vectors = [folded.sums for folded in folds]
    joined = torch.empty(sum(v.numel() for v in vectors), dtype=torch.float64, device=vectors[0].device)
    counted_sum = CountedSum(joined.numel(), counted, joined.device)

    def total() -> torch.Tensor:
        for folded in folds:
            folded.finish()
        if counted_sum.all:
            return vectors[0].sum() if len(vectors) == 1 else torch.cat(vectors, out=joined).sum()
        return counted_sum(torch.cat(vectors, out=joined))

    return _stage(total, t, comm, compiled, prescale, torch_amp)


def _result_math(outs, ins) -> None:
    nonfinite, found_inf, grad_norm = outs
    sumsq, inv_loss_scale = ins
    norm = scalar(sumsq).sqrt()
    torch.logical_not(torch.isfinite(norm), out=nonfinite)
    found_inf.copy_(nonfinite)
    torch.mul(norm, inv_loss_scale, out=grad_norm)


def _prescaled_result_math(outs, ins) -> None:
    """``_result_math`` over the sum of squares of prescaled grads: the norm times the prescale (fp64, exact),
    then unscaled as there: the same bits wherever the norm of the grads as they came is the same number."""
    nonfinite, found_inf, grad_norm = outs
    sumsq, inv_loss_scale, prescale = ins
    norm = scalar(sumsq).sqrt()
    torch.logical_not(torch.isfinite(norm), out=nonfinite)
    found_inf.copy_(nonfinite)
    torch.mul(norm * prescale, inv_loss_scale, out=grad_norm)


_RESULT = compiled_scalar_math.register("norm_result", _result_math)
_PRESCALED_RESULT = compiled_scalar_math.register("norm_result_prescaled", _prescaled_result_math)


def _stage(total: Callable[[], torch.Tensor], t: StepTensors, comm, compiled: bool,
           prescale: Optional[NormPrescale] = None, torch_amp=None) -> Stage:
    """``compiled``: the result's scalar math (norm, flags) as one compiled graph
    (graphstep/step/compiled_scalar_math.py). ``prescale``: the engine's ``NormPrescale`` (None where no loss
    scale can reach the grads); ``torch_amp``: torch's GradScaler's side (graphstep/step/torch_amp.py), whose
    scale sets the prescale of the next backward."""
    outs = [t.nonfinite, t.found_inf, t.grad_norm]
    from_step_scale = FromScale(t.norm_prescale, t.inv_loss_scale) if prescale is not None else None

    def apply() -> None:
        # Plus 0, or NaN where torch's GradScaler reported a non-finite grad (graphstep/step/torch_amp.py): before
        # the all-reduce, so that every rank decides that skip alike, from the one number.
        sumsq = total() + t.amp_found_inf_nan
        comm.all_reduce_sum(sumsq, "grad-norm all_reduce")
        # Host choices: the GradScaler's (the update stage reports it as baked too) and a constant scale's.
        if prescale is not None and prescale.active():
            _PRESCALED_RESULT(outs, [sumsq, t.inv_loss_scale, prescale.prescale], compiled=compiled)
        else:
            _RESULT(outs, [sumsq, t.inv_loss_scale], compiled=compiled)
        if prescale is not None and torch_amp is not None and torch_amp.scaled:
            # The next backward's folds go by this step's GradScaler scale (norm_prescale.py).
            from_step_scale()

    def baked() -> tuple:
        return (("norm", "prescaled", prescale.active()),) if prescale is not None else ()

    return Stage("norm", apply, baked)


def _prescale(domains) -> Optional[NormPrescale]:
    """The engine's ``NormPrescale``, handed to every sum of squares, and to the loss scaler to keep current; None
    where no loss scale can reach the grads."""
    ctx = domains[0]
    scaler, torch_amp = ctx.scaler, ctx.torch_amp
    if scaler is None and torch_amp is None:
        return None
    longest = max(g.numel() for c in domains for g in (*c.buffers.grad_shard, *c.buffers.grad_flat)
                  if g is not None)
    prescale = NormPrescale(ctx.tensors, ctx.buffers.scratch,
                            (lambda: scaler.prescales_norm) if scaler is not None else (lambda: torch_amp.scaled),
                            longest)
    if scaler is not None:
        scaler.keep_norm_prescale(ctx.tensors.norm_prescale)
    for c in domains:
        if c.folded is not None:
            c.folded.use_prescale(prescale)
    return prescale


def build(ctx, *others) -> Stage:
    """``others``: the expert domains' contexts (expert params, graphstep/plan/experts.py), whose sums of squares join
    this one's before its single all-reduce. With ``fold_grad_norm`` the sums were folded where the grads
    became final (graphstep.step.folded_sums) and the stage only adds them up."""
    domains = (ctx, *others)
    # One entry per grad_shard entry of each domain (a buffer, or with several ranks a bucket's shard), in the
    # order both paths sum them.
    counted = [entry for c in domains for entry in c.layout.shard_entries_counted()]
    prescale = _prescale(domains)
    if ctx.folded is not None:
        return build_folded([c.folded for c in domains], ctx.tensors, ctx.comm, ctx.compile_scalars, counted,
                            prescale, ctx.torch_amp)
    sums = [SumOfSquares(g) for c in domains for g in c.buffers.grad_shard]
    for sum_of_squares in sums:
        sum_of_squares.use_prescale(prescale)
    return build_over(sums, ctx.tensors, ctx.comm, ctx.compile_scalars, counted, prescale, ctx.torch_amp)
