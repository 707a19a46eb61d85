"""Lion kernel: bitwise against a hand reference in EO's op forms, close to the paper's formula and to
an element-by-element for-loop in double; skip bitwise; live hyperparameters under replay; capture-safe."""

import pytest
import torch

import capture
from graphstep.kernels.lion import LIVE_FIELDS, STATE_NAMES, lion

SIZES = [129, 1000, 64]


def hp(value):
    return torch.tensor(value, dtype=torch.float64)


def make_problem(seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    exp_avgs = [0.1 * torch.randn(n, generator=gen) for n in SIZES]
    return params, exp_avgs, gen


def grads_like(params, gen):
    return [torch.randn(p.shape, generator=gen) for p in params]


def run_lion(params, grads, exp_avgs, *, lr, beta1, beta2, wd, found_inf=0.0, grad_scale=2.0):
    lion(params, grads, exp_avgs, lr=hp(lr), beta1=hp(beta1), beta2=hp(beta2), weight_decay=hp(wd),
         grad_scale=None if grad_scale is None else torch.tensor(grad_scale), found_inf=torch.tensor(found_inf))


def reference_eo_step(p, g, m, *, lr, beta1, beta2, wd, grad_scale=2.0):
    """EO's Lion.step (WeightDecayMixin "decoupled", calculate_lion_update) with Python floats."""
    g = g / grad_scale
    p.add_(p, alpha=-(wd * lr))
    update = m.lerp(g, 1 - beta1).sign()
    m.lerp_(g, 1 - beta2)
    p.add_(update, alpha=-lr)


def schedule(step):
    return dict(lr=1e-3 * (1 + 0.1 * step), beta1=0.9 + 0.002 * step, beta2=0.98 + 0.0005 * step, wd=0.1 - 0.003 * step)


def test_matches_eo_op_forms_bitwise_over_20_steps():
    params, exp_avgs, gen = make_problem(0)
    ref_params, ref_avgs = [p.clone() for p in params], [m.clone() for m in exp_avgs]
    for step in range(20):
        grads = grads_like(params, gen)
        run_lion(params, grads, exp_avgs, **schedule(step))
        for p, g, m in zip(ref_params, grads, ref_avgs):
            reference_eo_step(p, g, m, **schedule(step))
    for got, want in zip(params + exp_avgs, ref_params + ref_avgs):
        assert torch.equal(got, want)


def test_paper_formula_within_one_ulp():
    # θ ← θ·(1 − lr·wd) − lr·sign(c), m ← β2·m + (1 − β2)·g as written in the paper: other rounding
    # (a multiply instead of EO's add), at most 1 ulp apart per step.
    params, exp_avgs, gen = make_problem(1)
    s = dict(lr=1e-3, beta1=0.95, beta2=0.98, wd=0.1)
    grads = grads_like(params, gen)
    expected, decayed = [], []
    for p, g, m in zip(params, grads, exp_avgs):
        g = g / 2.0
        c = s["beta1"] * m + (1 - s["beta1"]) * g
        decayed.append(p * (1 - s["lr"] * s["wd"]))
        expected.append(decayed[-1] - s["lr"] * torch.sign(c))
    run_lion(params, grads, exp_avgs, **s)
    for got, want, terms in zip(params, expected, decayed):
        # 1 ulp of the larger of the two terms subtracted: where they nearly cancel, the result's own ulp is
        # far finer than the rounding of either term (under ATEN_CPU_CAPABILITY=default, whose scalar loops round
        # apart from the vector ones, a param of -1.8e-5 came out 64 of its own ulps off, 1 ulp of the terms).
        larger = torch.maximum(terms.abs(), torch.full_like(terms, s["lr"])).maximum(want.abs())
        ulp = torch.nextafter(larger, torch.tensor(float("inf"))) - larger
        assert ((got - want).abs() <= ulp).all()  # measured: max 1 ulp, on ~20% of the elements


def test_elementwise_for_loop_in_double():
    gen = torch.Generator().manual_seed(2)
    p, g, m = (torch.randn(50, generator=gen) for _ in range(3))
    p0, g0, m0 = p.tolist(), g.tolist(), m.tolist()
    s = dict(lr=3e-3, beta1=0.9, beta2=0.99, wd=0.2)
    run_lion([p], [g], [m], grad_scale=None, **s)
    want_p, want_m = [], []
    for theta, grad, avg in zip(p0, g0, m0):
        c = s["beta1"] * avg + (1 - s["beta1"]) * grad
        sign = (c > 0) - (c < 0)
        want_p.append(theta - s["lr"] * (sign + s["wd"] * theta))
        want_m.append(s["beta2"] * avg + (1 - s["beta2"]) * grad)
    torch.testing.assert_close(p, torch.tensor(want_p, dtype=torch.float32), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, torch.tensor(want_m, dtype=torch.float32), rtol=1e-6, atol=1e-7)


def test_found_inf_skips_bitwise():
    params, exp_avgs, gen = make_problem(3)
    before = [t.clone() for t in params + exp_avgs]
    grads = grads_like(params, gen)
    grads[0][4] = float("nan")
    run_lion(params, grads, exp_avgs, found_inf=1.0, **schedule(0))
    for got, want in zip(params + exp_avgs, before):
        assert torch.equal(got, want)


def test_live_hyperparameters_replay_bitwise_with_eager():
    params, exp_avgs, gen = make_problem(4)
    eager_params, eager_avgs = [p.clone() for p in params], [m.clone() for m in exp_avgs]
    grads = [torch.zeros_like(p) for p in params]
    names = ("lr", "beta1", "beta2", "wd")
    live = {k: hp(0.0) for k in names}
    found_inf = torch.zeros(())

    def step():
        lion(params, grads, exp_avgs, lr=live["lr"], beta1=live["beta1"], beta2=live["beta2"],
             weight_decay=live["wd"], grad_scale=None, found_inf=found_inf)

    assert capture.check(step) == []  # also takes one step with all-zero hyperparameters
    for p, m in zip(eager_params, eager_avgs):  # that step: lerp by 1 moves m to g (= 0)
        m.zero_()
    graph = capture.graph(step, warmup=1, backend="replay")
    for i in range(10):
        new = grads_like(params, gen)
        for g, n in zip(grads, new):
            g.copy_(n)
        for k, v in schedule(i).items():
            live[k].fill_(v)
        found_inf.fill_(1.0 if i == 6 else 0.0)
        graph()
        if i != 6:
            run_lion(eager_params, new, eager_avgs, grad_scale=None, **schedule(i))
    assert graph.num_replays == 8
    for got, want in zip(params + exp_avgs, eager_params + eager_avgs):
        assert torch.equal(got, want)


def test_declarations_and_mismatched_lists():
    assert LIVE_FIELDS == {"lr", "beta1", "beta2", "weight_decay"} and STATE_NAMES == ("exp_avg",)
    params, exp_avgs, gen = make_problem(5)
    with pytest.raises(ValueError, match="one of each"):
        run_lion(params, grads_like(params, gen)[:2], exp_avgs, **schedule(0))
