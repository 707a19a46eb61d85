"""Moments (and fp16 main params) stored below fp32 never turn a finite fp32 run into NaN.

Per-tensor scaled storage (fp16, fp8) computes ``scale = amax / range`` and stores ``value / scale``. Transformer
Engine's rule turns three ordinary situations into NaN: an ``exp_avg_sq`` that overflows to inf (the scale
becomes inf, its inverse 0, and inf * 0 is stored), and a tensor whose largest moment is so small that the scale
is subnormal (its inverse is inf, and 0 * inf is stored), reached by tiny grads or by a moment decaying over
hundreds of steps. The oracle is the same run with fp32 moments: where its params are finite, ours are, and where
both are finite they stay close (drift relative to the motion, docs/design.md §8).
"""

import pytest
import torch

import graphstep as gs
from graphstep.config.validation import STATE_DTYPES

LOW = [dtype for dtype in STATE_DTYPES if dtype != torch.float32]
IDS = [str(dtype).removeprefix("torch.") for dtype in LOW]
EPS = 1e-8
# Drift of the params relative to their motion, per storage (a bf16 cast keeps 8 bits, fp16 11, e4m3 4).
DRIFT = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.uint8: 1e-1, torch.float8_e4m3fn: 1e-1}


class _Weights(torch.nn.Module):
    """Params whose grads a test sets exactly: the loss is sum(p * g), so p.grad == g."""

    def __init__(self, *shapes):
        super().__init__()
        torch.manual_seed(0)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(shape)) for shape in shapes)

    def backward_with(self, grads):
        sum((p * g.to(p.dtype)).sum() for p, g in zip(self.weights, grads)).backward()


def _optimizer(model, dtype, **extra):
    low = {} if dtype is None else dict(use_precision_aware_optimizer=True, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    config = dict(lr=1e-2, weight_decay=0.0, clip_grad=0.0, adam_eps=EPS, capture="eager", kernel="fused")
    return gs.get_optimizer(gs.OptimizerConfig(**{**config, **low, **extra}), model)


def _run(dtype, shapes, grads_at, steps, **extra):
    """Params after each of ``steps`` steps whose grads are ``grads_at(step)``, moments stored in ``dtype`` (None:
    fp32)."""
    model = _Weights(*shapes)
    opt = _optimizer(model, dtype, **extra)
    start = [p.detach().clone() for p in model.weights]
    history = []
    for step in range(steps):
        opt.zero_grad()
        model.backward_with(grads_at(step))
        opt.step()
        history.append([p.detach().clone() for p in model.weights])
    return start, history, opt


def _assert_like_fp32(dtype, shapes, grads_at, steps, drift, checked=None, **extra):
    """Our run against the fp32-moment run: finite at every step where it is, and at the end within ``drift`` of it
    (relative to its motion) for the params ``checked`` (default: all)."""
    start, ours, opt = _run(dtype, shapes, grads_at, steps, **extra)
    _, theirs, reference_opt = _run(None, shapes, grads_at, steps, **extra)
    for step, (mine, reference) in enumerate(zip(ours, theirs)):
        for k, (a, b) in enumerate(zip(mine, reference)):
            assert torch.isfinite(b).all(), f"the fp32 run itself went non-finite: param {k}, step {step}"
            bad = ~torch.isfinite(a)
            assert not bad.any(), (f"{dtype}: param {k} has {int(bad.sum())} non-finite elements at step {step} "
                                   "where the fp32-moment run has none")
    for k, (a, b, p0) in enumerate(zip(ours[-1], theirs[-1], start)):
        if checked is not None and k not in checked:
            continue
        motion = (b - p0).norm()
        assert motion > 0
        assert (a - b).norm() / motion <= drift, f"{dtype}: param {k} drifted {(a - b).norm() / motion:.3g}"
    return ours, theirs, opt, reference_opt


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
def test_an_overflowing_second_moment_holds_inf_and_stops_that_element_as_fp32_does(dtype):
    """A 1e30 grad, unclipped: grad² overflows, fp32's exp_avg_sq holds inf, so that element's update is 0 from then
    on and every param stays finite. Ours must do the same (other params unaffected)."""
    def grads_at(step):
        torch.manual_seed(step)
        grads = [torch.randn(4, 8) * 1e-2, torch.randn(16) * 1e-2]
        if step == 2:
            grads[0][1, 3] = 1e30
        return grads

    # Param 0's other elements lose their first moment while the 1e30 one dominates its scale (README): not compared.
    ours, theirs, opt, reference_opt = _assert_like_fp32(dtype, [(4, 8), (16,)], grads_at, 8, DRIFT[dtype], checked=[1])
    for mine, reference in zip(ours[2:], theirs[2:]):  # stopped from the 1e30 step on, as fp32 stops it
        assert reference[0][1, 3] == theirs[1][0][1, 3]
        assert mine[0][1, 3] == ours[1][0][1, 3]
    second = opt.buffers.full_shard("exp_avg_sq", 0)
    assert torch.equal(torch.isinf(second), torch.isinf(reference_opt.buffers.full_shard("exp_avg_sq", 0)))
    assert torch.isinf(second).sum() == 1 and not torch.isnan(second).any()


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
def test_tiny_grads_beside_zeros_do_not_give_a_subnormal_scale(dtype):
    """Grads of 1e-16 (1e-17) beside exact zeros: exp_avg_sq ≈ 1e-35 (1e-37), so amax / 32752 (amax / 448) is
    subnormal and its inverse inf."""
    def grads_at(step):
        grads = [torch.zeros(4, 8), torch.zeros(4, 8)]
        for grad, size in zip(grads, (1e-16, 1e-17)):
            grad[0, :4] = size * (1 + step % 3)
        return grads

    # ε far below √exp_avg_sq, so that the update is lr-sized and the moments' precision shows in the params.
    _assert_like_fp32(dtype, [(4, 8), (4, 8)], grads_at, 6, DRIFT[dtype], adam_eps=1e-30)


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
def test_a_moment_decaying_for_hundreds_of_steps_stays_finite(dtype):
    """One element gets one grad of 1e-3, none after, its neighbour never: exp_avg decays as 1e-4 · 0.9^t, and
    after about 700 steps amax / range is subnormal (the next test). β1 = 0.5 reaches that regime in about 100
    steps: 5e-4 · 0.5^t / 448 < 2^-126 from t ≈ 107 (from t ≈ 101 with float16's range, 32752)."""
    def grads_at(step):
        return [torch.tensor([1e-3 if step == 0 else 0.0, 0.0])]

    _assert_like_fp32(dtype, [(2,)], grads_at, 160, DRIFT[dtype], adam_beta1=0.5)


def test_a_moment_decaying_for_hundreds_of_steps_stays_finite_with_the_default_betas():
    def grads_at(step):
        return [torch.tensor([1e-3 if step == 0 else 0.0, 0.0])]

    _assert_like_fp32(torch.float8_e4m3fn, [(2,)], grads_at, 760, DRIFT[torch.float8_e4m3fn])


@pytest.mark.parametrize("dtype", LOW, ids=IDS)
def test_a_skipped_step_with_inf_and_tiny_moments_leaves_every_stored_byte(dtype):
    def grads_at(step):
        grad = torch.zeros(4, 8)
        grad[0, 0], grad[1, :3] = 1e30, 1e-16
        return [grad]

    _, _, opt = _run(dtype, [(4, 8)], grads_at, 2)
    stored = {name: [(s.data.view(torch.uint8).clone(), None if s.scales is None else s.scales.clone())
                     for s in per_buffer if s is not None] for name, per_buffer in opt.buffers.stored.items()}
    params = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    opt.zero_grad()
    grad = torch.zeros(4, 8)
    grad[2, 2] = float("nan")
    sum((p * grad).sum() for p in opt.param_groups[0]["params"]).backward()
    assert not bool(opt.step().update_successful)
    for name, per_buffer in opt.buffers.stored.items():
        for (data, scales), s in zip(stored[name], [s for s in per_buffer if s is not None]):
            assert torch.equal(data, s.data.view(torch.uint8)), name
            assert scales is None or torch.equal(scales, s.scales), name
    assert all(torch.equal(a, b) for a, b in zip(params, opt.param_groups[0]["params"]))


def test_fp16_main_params_of_tiny_values_stay_finite():
    """fp16 main params (bf16 params) are scaled per piece too: a param whose values are all below 2^-126 · 32752
    (weight decay shrinks an unused one there) must not get a subnormal scale."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.mul_(1e-35)
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2, clip_grad=0.0, bf16=True, capture="eager", kernel="fused",
                                              use_precision_aware_optimizer=True, main_params_dtype=torch.float16,
                                              store_param_remainders=False), model)
    before = model.weight.detach().float().clone()
    for _ in range(3):
        opt.zero_grad()
        model.bias.sum().backward()  # the weight gets a zero grad: Adam leaves it where it is
        opt.step()
    assert torch.isfinite(model.weight).all()
    assert torch.allclose(model.weight.float(), before, rtol=2e-2, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=["float16", "float8_e4m3fn"])
def test_captured_steps_store_inf_and_tiny_moments_as_eager_does_bitwise(dtype):
    def grads_at(step):
        grad = torch.zeros(4, 8)
        grad[0, 0], grad[1, :3] = (1e30 if step == 1 else 1e-2), 1e-17
        return [grad]

    _, eager, eager_opt = _run(dtype, [(4, 8)], grads_at, 6)
    _, graph, graph_opt = _run(dtype, [(4, 8)], grads_at, 6, capture="graph", capture_warmup_steps=1)
    assert graph_opt.captured
    assert all(torch.equal(a, b) for a, b in zip(eager[-1], graph[-1]))
    for name in ("exp_avg", "exp_avg_sq"):
        ours, theirs = eager_opt.buffers.stored[name][0], graph_opt.buffers.stored[name][0]
        assert torch.equal(ours.data.view(torch.uint8), theirs.data.view(torch.uint8)), name
        assert torch.equal(ours.scales, theirs.scales), name
