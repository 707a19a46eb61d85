"""Newton–Schulz orthogonalisation over a batch of same-shape matrices, as Muon uses it.

``newton_schulz(x)`` takes (n, r, c) and returns, per matrix, an approximation of the polar factor U Vᵀ of its
SVD, following emerging-optimizers (EO) 0.3.0, which Megatron-Core pins: transpose when r > c, Frobenius-
normalise in fp32 (eps 1e-7), bf16 matmuls under "medium" precision else fp32, then per step
A = X Xᵀ, X = a·X + (b·A + c·A²)·X as batched matmuls, so n matrices cost the kernels of one. The batched ops
round like EO's per-matrix mm/addmm on the CPU (tested bitwise). Capture-safe: no host reads; the coefficients
are constants of the method, fixed at build.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

# EO 0.3.0 normalisation floor (torch.optim.Muon uses the same 1e-7; EO HEAD moved to 1e-15).
NS_EPS = 1e-7

# (a, b, c) per iteration. Sources:
# - "simple": Keller Jordan's Muon (also torch.optim.Muon's default), one tuple repeated.
# - "quintic": five tuples from modded-nanogpt, used by EO as its default; cycled, so the step count must
#   be a multiple of 5 (EO raises otherwise).
# - "polar_express": Amsel, Persson, Musco, Gower, "The Polar Express" (arXiv:2505.16932), Algorithm 1:
#   eight minimax-optimal quintics, the first seven divided by the safety factor (1.01, 1.01³, 1.01⁵);
#   rounded to 4 decimals as EO lists them. EO requires at
#   least 8 steps and repeats the last tuple beyond 8 (following the paper).
COEFFICIENT_SETS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
}

MATMUL_PRECISIONS = ("medium", "high", "highest")


def coefficient_schedule(coefficient_type: str, num_steps: int) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of each of the ``num_steps`` iterations, by EO's rules for each set."""
    if coefficient_type not in COEFFICIENT_SETS:
        raise ValueError(f"muon coefficient_type={coefficient_type!r}: must be one of "
                         f"{', '.join(map(repr, COEFFICIENT_SETS))}")
    if num_steps < 1:
        raise ValueError(f"muon num_ns_steps={num_steps}: must be at least 1")
    table = COEFFICIENT_SETS[coefficient_type]
    if coefficient_type == "simple":
        return table * num_steps
    if coefficient_type == "polar_express":
        if num_steps < len(table):
            raise ValueError(f"muon num_ns_steps={num_steps}: polar_express is tuned for {len(table)} steps; "
                             f"use at least {len(table)} (later steps repeat the last tuple)")
        return table + table[-1:] * (num_steps - len(table))
    if num_steps % len(table):
        raise ValueError(f"muon num_ns_steps={num_steps}: {coefficient_type!r} cycles {len(table)} tuples; "
                         f"use a multiple of {len(table)}")
    return table * (num_steps // len(table))


@contextlib.contextmanager
def matmul_precision(precision: str):
    """torch's global fp32 matmul precision set to ``precision`` for the block, restored after.

    A host-side setting: under capture it decides which kernels are recorded. On torch's CPU builds
    "medium" lets oneDNN run fp32 matmuls in reduced precision, so the fp32 path must not inherit it.

    Restored exactly: the legacy setter also writes the per-backend ``fp32_precision`` flags (from "none"
    to "ieee" on the way back to "highest"), and those are global state that torch.compile's later
    compiles read; so the flags are saved and put back as they were, not re-derived from the name.
    """
    previous = torch.get_float32_matmul_precision()
    flags = [(backend, backend.fp32_precision) for backend in _precision_backends()]
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
        for backend, flag in flags:
            backend.fp32_precision = flag


def _precision_backends() -> list:
    """The per-backend matmul precision flags this torch has (``torch.backends.<x>.matmul.fp32_precision``),
    whichever backends those are."""
    found = []
    for name in sorted(vars(torch.backends)):
        matmul = getattr(vars(torch.backends)[name], "matmul", None)
        if matmul is not None and hasattr(matmul, "fp32_precision"):
            found.append(matmul)
    return found


def newton_schulz_split(x: torch.Tensor, *, split_dim: int, global_shape: tuple[int, int], all_reduce,
                        num_steps: int, coefficient_type: str = "quintic", fp32_matmul_prec: str = "medium",
                        eps: float = NS_EPS) -> torch.Tensor:
    """``newton_schulz`` of matrices split over ranks: ``x`` (n, r, c) is this rank's slice along
    ``split_dim`` (1: rows, 2: columns) of matrices of ``global_shape``; ``all_reduce(t)`` sums ``t`` in place
    over the ranks holding the other slices. Returns this rank's slice of the orthogonalised matrices.

    The Frobenius norm is the sum of the slices' squares. Oriented as ``newton_schulz`` orients the whole
    matrix (transposed when it has more rows than columns), the slice either cuts the columns, where
    X Xᵀ is the sum of the slices' own X Xᵀ, or the rows, where each step is rewritten as
    X ← a·X + X·(b·G + c·G²) with G = Xᵀ X the sum of the slices' Xᵀ X (the same polynomial:
    (X Xᵀ)ᵏ X = X (Xᵀ X)ᵏ). Equal to the whole-matrix iteration up to the order of the sums."""
    if x.dim() != 3 or split_dim not in (1, 2):
        raise ValueError(f"newton_schulz_split: (n, r, c) slices split along dim 1 or 2, got shape {tuple(x.shape)} "
                         f"and split_dim={split_dim}")
    schedule = coefficient_schedule(coefficient_type, num_steps)
    transpose = global_shape[0] > global_shape[1]
    if transpose:
        x = x.mT
        split_dim = 3 - split_dim
    sumsq = x.square().sum(dim=(-2, -1), keepdim=True)
    all_reduce(sumsq)
    X = x / sumsq.sqrt().clamp_min(eps)
    with matmul_precision(fp32_matmul_prec):
        if fp32_matmul_prec == "medium":
            X = X.to(torch.bfloat16)
        for a, b, c in schedule:
            if split_dim == 2:  # the columns are split: X Xᵀ is summed over the slices
                A = torch.bmm(X, X.mT)
                A = _summed(A, all_reduce)
                B = torch.baddbmm(A, A, A, beta=b, alpha=c)
                X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
            else:  # the rows are split: Xᵀ X is summed over the slices
                G = _summed(torch.bmm(X.mT, X), all_reduce)
                B = torch.baddbmm(G, G, G, beta=b, alpha=c)
                X = torch.baddbmm(X, X, B, beta=a, alpha=1.0)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def _summed(t: torch.Tensor, all_reduce) -> torch.Tensor:
    """``t`` summed over the ranks, in fp32 (a bf16 Gram matrix is summed in fp32, then cast back)."""
    wide = t.to(torch.float32)
    all_reduce(wide)
    return wide.to(t.dtype)


def newton_schulz(x: torch.Tensor, *, num_steps: int, coefficient_type: str = "quintic",
                  fp32_matmul_prec: str = "medium", eps: float = NS_EPS,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Orthogonalise each matrix of ``x`` (n, r, c), fp32; returns a new fp32 (n, r, c) tensor, or ``out``
    holding the result when given (fp32, ``x``'s shape; it may be ``x`` itself: ``x`` is read only before the
    iterations, so a caller done with its input saves a batch-sized temporary)."""
    if x.dim() != 3:
        raise ValueError(f"newton_schulz expects a batch of matrices (n, rows, cols), got shape {tuple(x.shape)}; "
                         f"use x.unsqueeze(0) for a single matrix")
    if x.dtype != torch.float32:
        raise TypeError(f"newton_schulz expects float32 input (Muon runs on fp32 main params), got {x.dtype}")
    if out is not None and (out.shape != x.shape or out.dtype != torch.float32):
        raise ValueError(f"newton_schulz: out must be float32 of the input's shape {tuple(x.shape)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if fp32_matmul_prec not in MATMUL_PRECISIONS:
        raise ValueError(f"muon fp32_matmul_prec={fp32_matmul_prec!r}: must be one of "
                         f"{', '.join(map(repr, MATMUL_PRECISIONS))}")
    schedule = coefficient_schedule(coefficient_type, num_steps)
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    # Same op form as torch.nn.functional.normalize over the last two dims (what EO calls). The quotient is
    # written straight into the matmul dtype: one rounding of the fp32 quotient either way, and no fp32 copy.
    norm = x.norm(2, dim=(-2, -1), keepdim=True).clamp_min(eps)
    X = torch.div(x, norm, out=torch.empty_like(x, dtype=_matmul_dtype(fp32_matmul_prec)))
    # fp32 matmuls write their last iterate straight into ``out`` where it has the layout a fresh result has.
    oriented = None if out is None else out.mT if transpose else out
    last = oriented if oriented is not None and X.dtype == torch.float32 and oriented.is_contiguous() else None
    with matmul_precision(fp32_matmul_prec):
        X = _iterate(X, schedule, last)
    if out is None:
        X = X.to(torch.float32)
        return X.mT if transpose else X
    if X is not last:
        oriented.copy_(X)  # bf16 to fp32 is exact: the values .to(torch.float32) gives
    return out


def _matmul_dtype(fp32_matmul_prec: str) -> torch.dtype:
    return torch.bfloat16 if fp32_matmul_prec == "medium" else torch.float32


def _iterate(X: torch.Tensor, schedule, last: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Newton–Schulz steps on the normalised ``X`` (n, r, c), r <= c; returns the last iterate, written
    into ``last`` when given (contiguous, ``X``'s shape and dtype, none of ``X``'s memory).

    Each matmul writes through ``out=`` into one of four scratch tensors allocated here (the Gram matrix, its
    polynomial, two iterates taking turns), not into a fresh tensor per op: on the CPU replay backend every
    temporary is allocated anew at each replay, page by page for a large batch. The scratch tensors are
    contiguous, as each op's own result would be, so the kernels and their rounding are the ones the
    functional calls run (checked bitwise against one matrix at a time in the tests)."""
    n, rows, cols = X.shape
    gram = X.new_empty((n, rows, rows))
    poly = X.new_empty((n, rows, rows))
    final = (len(schedule) - 1) % 2
    turns = [last if last is not None and turn == final else X.new_empty((n, rows, cols))
             for turn in range(min(2, len(schedule)))]
    for i, (a, b, c) in enumerate(schedule):
        torch.bmm(X, X.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        X = torch.baddbmm(X, poly, X, beta=a, alpha=1.0, out=turns[i % 2])
    return X
