"""Muon's update over batches of same-shape matrices: one call of the kernels per distinct shape.

``params``, ``grads`` and ``momentum_buffers`` are lists of 3-D fp32 views (n, r, c), one per distinct shape;
params and buffers are updated in place, grads only read. Per matrix, in emerging-optimizers (EO) 0.3.0's order:
grads divided by ``grad_scale``; weight decay first (decoupled ``p.add_(p, alpha=-(wd*lr))``, or L2 when
``decoupled=False``); EMA momentum (the update ``lerp(g, m, μ)`` with nesterov, else ``m``); Newton–Schulz
times the shape scale and ``extra_scale_factor``; ``p ← p + (−lr)·O``. ``torch.addcmul`` with a 0-d fp64
tensor rounds like EO's ``add_(alpha=float)`` on the CPU, so the result is bitwise EO's. lr, weight_decay and
momentum are live (``LIVE_FIELDS``); the rest are fixed at build. ``found_inf`` (0-d fp32, 1.0 = skip) leaves
params and momentum bitwise unchanged. A ``QKVSplit`` entry is orthogonalised as its Q, K and V matrices; a
``TensorParallelSplit`` entry by ``tp_mode``: "duplicated" gathers whole matrices, "distributed" runs
Newton–Schulz over the group's slices, "blockwise" orthogonalises each slice alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .newton_schulz import NS_EPS, newton_schulz, newton_schulz_split

LIVE_FIELDS = frozenset({"lr", "weight_decay", "momentum"})
STATE_NAMES = ("momentum_buffer",)
SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
TP_MODES = ("duplicated", "distributed", "blockwise")  # OptimizerConfig.muon_tp_mode


@dataclass(frozen=True)
class TensorParallelSplit:
    """A run of matrices split over the tensor-parallel group: this rank holds slice ``rank`` of ``world``
    equal slices along ``dim`` (0: rows, 1: columns) of each. ``all_gather(out, inp)`` writes every rank's
    ``inp`` into ``out`` (flat, rank after rank); ``all_reduce(t)`` sums ``t`` in place over the group. Both
    are the step's collectives (graphstep/parallel/collectives.py), passed in: the kernels talk to no group."""

    dim: int
    world: int
    rank: int
    all_gather: Callable[[torch.Tensor, torch.Tensor], None]
    all_reduce: Callable[[torch.Tensor], None]

    def global_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return (rows * self.world, cols) if self.dim == 0 else (rows, cols * self.world)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole matrices of this rank's slices ``x`` (n, r, c)."""
        n, rows, cols = x.shape
        out = torch.empty(self.world * x.numel(), dtype=x.dtype, device=x.device)
        self.all_gather(out, x.contiguous().view(-1))
        slices = out.view(self.world, n, rows, cols)
        return torch.cat(slices.unbind(0), dim=1 + self.dim)

    def local(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``whole`` (n, R, C)."""
        size = whole.size(1 + self.dim) // self.world
        return whole.narrow(1 + self.dim, self.rank * size, size)


def scale_factor(rows: int, cols: int, scale_mode: str) -> float:
    """The update scale for a (rows, cols) matrix, as EO's ``get_muon_scale_factor`` computes it."""
    if scale_mode == "spectral":
        return max(rows, cols) ** 0.5
    if scale_mode == "shape_scaling":
        return max(1, rows / cols) ** 0.5
    if scale_mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"muon scale_mode={scale_mode!r}: must be one of {', '.join(map(repr, SCALE_MODES))}")


@dataclass(frozen=True)
class QKVSplit:
    """Megatron's fused QKV rows: ``num_groups`` query groups, each ``q_rows + k_rows + v_rows`` rows.

    ``q_rows`` = heads per group × kv_channels, ``k_rows`` = ``v_rows`` = kv_channels (GQA); with tensor
    parallelism, the local groups. Q, K and V are each gathered over all groups into one matrix
    (num_groups·q_rows, cols), etc., orthogonalised and scaled by that matrix's shape.
    """

    num_groups: int
    q_rows: int
    k_rows: int
    v_rows: int

    @property
    def rows_per_group(self) -> int:
        return self.q_rows + self.k_rows + self.v_rows

    def check(self, rows: int) -> None:
        if rows != self.num_groups * self.rows_per_group:
            raise ValueError(f"{self}: a fused QKV weight with {rows} rows does not hold {self.num_groups} groups "
                             f"of {self.rows_per_group} rows; pass the local (tensor-parallel) group count")


def orthogonalize(update: torch.Tensor, *, ns_steps: int, coefficient_type: str, scale_mode: str,
                  extra_scale_factor: float, fp32_matmul_prec: str, eps: float = NS_EPS,
                  tp: Optional[TensorParallelSplit] = None, distributed: bool = False,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """NS of each matrix of ``update`` (n, r, c) times its shape scale and ``extra_scale_factor``.

    ``tp``: ``update`` is this rank's slice of matrices split over the tensor-parallel group; the scale is
    the whole matrix's, and with ``distributed`` Newton–Schulz runs on the slices together
    (``newton_schulz_split``), else on the slice alone (blockwise). ``out``: where ``newton_schulz`` writes
    the result (it may be ``update``); the result is returned either way."""
    rows, cols = update.size(-2), update.size(-1)
    if tp is not None:
        rows, cols = tp.global_shape(rows, cols)
    if tp is not None and distributed:
        orth = newton_schulz_split(update, split_dim=1 + tp.dim, global_shape=(rows, cols),
                                   all_reduce=tp.all_reduce, num_steps=ns_steps, coefficient_type=coefficient_type,
                                   fp32_matmul_prec=fp32_matmul_prec, eps=eps)
    else:
        orth = newton_schulz(update, num_steps=ns_steps, coefficient_type=coefficient_type,
                             fp32_matmul_prec=fp32_matmul_prec, eps=eps, out=out)
    # Two multiplies by Python floats, as EO does: `update * scale_factor * extra_scale_factor`; in place, as
    # ``orth`` is this call's own tensor (or ``out``), and skipped for a factor of 1.0 (x * 1.0 == x in IEEE
    # arithmetic).
    for factor in (scale_factor(rows, cols, scale_mode), extra_scale_factor):
        if factor != 1.0:
            orth.mul_(factor)
    return orth


def orthogonalize_qkv(update: torch.Tensor, split: QKVSplit, **ns_options) -> torch.Tensor:
    """``orthogonalize`` of the gathered Q, K and V matrices of each fused weight in ``update`` (n, R, C).

    Returns (n, R, C) with every row back in its fused position. When K and V have the same shape they
    go through one batched call of 2n matrices, so a split costs two NS calls, not three. A tensor-parallel
    ``tp`` in ``ns_options`` applies to each of the three: a column-parallel QKV weight is split by query
    groups, so each of Q, K and V is split along its rows.
    """
    n, rows, cols = update.shape
    split.check(rows)
    grouped = update.reshape(n, split.num_groups, split.rows_per_group, cols)
    q, k, v = torch.split(grouped, (split.q_rows, split.k_rows, split.v_rows), dim=2)
    gather = lambda part: part.reshape(n, -1, cols)  # noqa: E731 - (n, groups·rows, cols), a copy
    q_orth = orthogonalize(gather(q), **ns_options)
    if split.k_rows == split.v_rows:
        k_orth, v_orth = orthogonalize(torch.cat((gather(k), gather(v))), **ns_options).split(n)
    else:
        k_orth, v_orth = orthogonalize(gather(k), **ns_options), orthogonalize(gather(v), **ns_options)
    parts = [part.reshape(n, split.num_groups, -1, cols) for part in (q_orth, k_orth, v_orth)]
    return torch.cat(parts, dim=2).reshape(n, rows, cols)


def _check_views(params, grads, momentum_buffers, qkv_splits) -> None:
    if not len(params) == len(grads) == len(momentum_buffers) == len(qkv_splits):
        raise ValueError(f"muon: {len(params)} params, {len(grads)} grads, {len(momentum_buffers)} momentum buffers"
                         f" and {len(qkv_splits)} qkv_splits: pass one entry of each per shape")
    for param, grad, buf in zip(params, grads, momentum_buffers):
        if param.dim() != 3 or param.shape != grad.shape or param.shape != buf.shape:
            raise ValueError(f"muon expects (n, rows, cols) views of equal shape for param, grad and momentum "
                             f"buffer, got {tuple(param.shape)}, {tuple(grad.shape)}, {tuple(buf.shape)}")
        if param.dtype != torch.float32 or buf.dtype != torch.float32:
            raise TypeError(f"muon runs on fp32 main params and state, got {param.dtype} / {buf.dtype}")


def _orthogonalize_entry(update: torch.Tensor, qkv: Optional[QKVSplit], tp: Optional[TensorParallelSplit],
                         tp_mode: str, ns_options: dict) -> torch.Tensor:
    """One entry's orthogonalised update: whole matrices, or slices split over the tensor-parallel group
    handled as ``tp_mode`` says (duplicated: gather, orthogonalise the whole, keep this rank's slice)."""
    if tp is not None and tp_mode == "duplicated":
        whole = tp.gather(update)
        if qkv is None:
            return tp.local(orthogonalize(whole, **ns_options))
        whole_qkv = QKVSplit(qkv.num_groups * tp.world, qkv.q_rows, qkv.k_rows, qkv.v_rows)  # groups split by rank
        return tp.local(orthogonalize_qkv(whole, whole_qkv, **ns_options))
    if tp is not None:
        ns_options = dict(ns_options, tp=tp, distributed=tp_mode == "distributed")
    if qkv is not None:
        return orthogonalize_qkv(update, qkv, **ns_options)
    return orthogonalize(update, **ns_options, out=update)  # the caller is done with ``update``


def muon(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], momentum_buffers: Sequence[torch.Tensor],
         *, lr: torch.Tensor, weight_decay: torch.Tensor, momentum: torch.Tensor, nesterov: bool, decoupled: bool,
         grad_scale: Optional[torch.Tensor], found_inf: torch.Tensor, ns_steps: int, coefficient_type: str,
         scale_mode: str, extra_scale_factor: float, fp32_matmul_prec: str,
         qkv_splits: Optional[Sequence[Optional[QKVSplit]]] = None, eps: float = NS_EPS,
         tp_splits: Optional[Sequence[Optional[TensorParallelSplit]]] = None, tp_mode: str = "duplicated") -> None:
    """One Muon step over each (n, r, c) entry, in place; see the module docstring for the rule. ``tp_splits``:
    per entry, how its matrices are split over the tensor-parallel group (None: whole), handled as
    ``tp_mode`` says (``TP_MODES``)."""
    qkv_splits = list(qkv_splits) if qkv_splits is not None else [None] * len(params)
    tp_splits = list(tp_splits) if tp_splits is not None else [None] * len(params)
    if tp_mode not in TP_MODES:
        raise ValueError(f"muon tp_mode={tp_mode!r}: must be one of {', '.join(map(repr, TP_MODES))}")
    _check_views(params, grads, momentum_buffers, qkv_splits)
    ns_options = dict(ns_steps=ns_steps, coefficient_type=coefficient_type, scale_mode=scale_mode,
                      extra_scale_factor=extra_scale_factor, fp32_matmul_prec=fp32_matmul_prec, eps=eps)
    keep = found_inf == 0
    neg_lr = -lr
    neg_decay = -(weight_decay * lr)
    # lerp wants its tensor weight in the input's dtype; the cast of the fp64 (1 - μ) rounds like the
    # Python float EO passes.
    momentum_weight = (1 - momentum).to(torch.float32)
    nesterov_weight = momentum.to(torch.float32)
    for param, grad, buf, split, tp in zip(params, grads, momentum_buffers, qkv_splits, tp_splits, strict=True):
        # Results go through out= into tensors this step already holds, not into a fresh tensor per op (on the
        # CPU replay backend each would be allocated anew at every replay): the Nesterov update into the
        # step's own grad (scaled or with L2 decay), the momentum now, the orthogonalised update into
        # ``update`` (whole matrices, no QKV split), the new params into ``new_buf`` (or that grad) once nothing
        # reads it.
        own_grad = {}
        if grad_scale is not None:
            grad = grad / grad_scale
            own_grad = {"out": grad}
        if not decoupled:
            grad = torch.mul(param, weight_decay).add_(grad)  # wd·p + g: the sum g + wd·p rounds to
            own_grad = {"out": grad}
        new_buf = buf.lerp(grad, momentum_weight)
        update = torch.lerp(grad, new_buf, nesterov_weight, **own_grad) if nesterov else new_buf
        torch.where(keep, new_buf, buf, out=buf)
        orth = _orthogonalize_entry(update, split, tp, tp_mode, ns_options)
        spare = next(({"out": t} for t in (new_buf, own_grad.get("out")) if t is not None and t is not orth), {})
        if decoupled:
            new_param = torch.addcmul(param, neg_decay, param, **spare).addcmul_(neg_lr, orth)
        else:
            new_param = torch.addcmul(param, neg_lr, orth, **spare)
        torch.where(keep, new_param, param, out=param)
