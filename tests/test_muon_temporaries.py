"""How much fresh memory one Muon step allocates, counted in the batch's own fp32 bytes.

On the CPU replay backend every temporary is allocated anew at each replay (no private pool), and a
temporary the size of a whole batch of matrices comes from the operating system page by page: the step's
cost beyond its matmuls grows with the number of such temporaries. So the kernel writes through ``out=``
into a few scratch tensors and into the params and momentum in place. These tests count the bytes of
every fresh tensor an op returns (views and ``out=`` results share an input's storage and are not fresh).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import capture
from graphstep.kernels.muon import muon
from graphstep.kernels.newton_schulz import newton_schulz
from test_muon import grads_like, hp, make_problem, run_graphstep, run_reference, schedule


class FreshBytes(TorchDispatchMode):
    """Sums the bytes of op outputs whose storage is none of the op's inputs'."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out


def fresh_batches(precision, nesterov=True, shape=(64, 64), batch=4, grad_scale=None, decoupled=True):
    """Fresh bytes of one step over one (batch, *shape) entry, in units of that entry's fp32 bytes."""
    params, bufs, gen = make_problem(0, shapes=[shape], batch=batch)
    grads = grads_like(params, gen)
    with FreshBytes() as counter:
        run_graphstep(params, bufs, grads, lr=0.02, wd=0.1, mu=0.95, nesterov=nesterov, grad_scale=grad_scale,
                      decoupled=decoupled, fp32_matmul_prec=precision)
    return counter.bytes / params[0].nbytes


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("grad_scale,decoupled", [(None, True), (torch.tensor(2.0), True), (None, False)])
def test_the_bf16_step_allocates_two_fp32_and_five_bf16_temporaries_at_most(nesterov, grad_scale, decoupled):
    # fp32: the new momentum and the Nesterov update (which then holds the orthogonalised update; without
    # Nesterov, the decayed params instead; the update goes into a scaled or L2-decayed grad); bf16 (half the
    # bytes): the normalised input, two iterates taking turns, the Gram matrix and its polynomial.
    assert fresh_batches("medium", nesterov, grad_scale=grad_scale, decoupled=decoupled) <= 2 + 5 / 2 + 0.01


def test_the_fp32_step_allocates_six_fp32_temporaries_at_most():
    # The new momentum, the Nesterov update (which takes the last iterate), the normalised input, one more
    # iterate, the Gram matrix and its polynomial.
    assert fresh_batches("highest") <= 6 + 0.01


def test_newton_schulz_leaves_its_input_alone_and_a_tall_batch_matches_one_matrix_at_a_time():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 48, 24, generator=gen)
    before = x.clone()
    for precision in ("medium", "highest"):
        batched = newton_schulz(x, num_steps=5, coefficient_type="quintic", fp32_matmul_prec=precision)
        singly = torch.cat([newton_schulz(m.unsqueeze(0), num_steps=5, coefficient_type="quintic",
                                          fp32_matmul_prec=precision) for m in x])
        assert torch.equal(batched, singly)
    assert torch.equal(x, before)


def test_views_with_gaps_between_matrices_match_the_reference_bitwise():
    # The engine's views: matrices at a spacing wider than rows * cols (alignment), cut by as_strided.
    gen = torch.Generator().manual_seed(4)
    rows, cols, batch, spacing = 40, 24, 3, 40 * 24 + 32
    flat = {name: torch.zeros(batch * spacing) for name in ("param", "buf", "grad")}
    view = {name: t.as_strided((batch, rows, cols), (spacing, cols, 1)) for name, t in flat.items()}
    view["param"].copy_(torch.randn(batch, rows, cols, generator=gen))
    ref_params, ref_bufs = [view["param"].clone()], [view["buf"].clone()]
    for step in range(3):
        view["grad"].copy_(torch.randn(batch, rows, cols, generator=gen))
        grads = [view["grad"].clone()]
        run_graphstep([view["param"]], [view["buf"]], [view["grad"]], nesterov=True, fp32_matmul_prec="medium",
                      **schedule(step))
        run_reference(ref_params, ref_bufs, grads, nesterov=True, fp32_matmul_prec="medium", **schedule(step))
    assert torch.equal(view["param"], ref_params[0]) and torch.equal(view["buf"], ref_bufs[0])
    gaps = flat["param"].view(batch, spacing)[:, rows * cols:]
    assert not gaps.any()  # nothing written between the matrices


@pytest.mark.parametrize("nesterov", [True, False])
def test_found_inf_replayed_leaves_params_and_momentum_bitwise(nesterov):
    params, bufs, gen = make_problem(5)
    grads = [torch.zeros_like(p) for p in params]
    found_inf = torch.zeros(())
    lr, weight_decay, momentum = hp(0.02), hp(0.1), hp(0.9)

    def step():
        muon(params, grads, bufs, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
             decoupled=True, grad_scale=None, found_inf=found_inf, ns_steps=5, coefficient_type="simple",
             scale_mode="shape_scaling", extra_scale_factor=1.0, fp32_matmul_prec="medium")

    graph = capture.graph(step, warmup=1, backend="replay")
    for _ in range(3):
        for g, new in zip(grads, grads_like(params, gen)):
            g.copy_(new)
        graph()
    before = [t.clone() for t in params + bufs]
    grads[0][1, 2, 3] = float("nan")
    found_inf.fill_(1.0)
    graph()
    for got, want in zip(params + bufs, before):
        assert torch.equal(got, want)


@pytest.mark.parametrize("precision", ["medium", "highest"])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
@pytest.mark.parametrize("steps", [1, 5])
def test_newton_schulz_into_its_own_input_equals_a_fresh_result_bitwise(precision, shape, steps):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, *shape, generator=gen)
    options = dict(num_steps=steps, coefficient_type="simple", fp32_matmul_prec=precision)
    fresh = newton_schulz(x, **options)
    assert newton_schulz(x, **options, out=x) is x
    assert torch.equal(x, fresh)


def test_newton_schulz_refuses_an_out_of_another_shape_or_dtype():
    x = torch.randn(2, 8, 4)
    for out in (torch.empty(2, 4, 8), torch.empty(2, 8, 4, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="out must be float32 of the input's shape"):
            newton_schulz(x, num_steps=5, out=out)
