"""The grad norm at every loss scale the config accepts ([2**-126, 2**127]): the norm is taken of the still-scaled
grads, whose fp32 row sums of squares overflow under a large scale and underflow under a tiny one. Oracle:
``torch.nn.utils.clip_grad_norm_``'s total norm of the unscaled grads.

The grads come from ``(p * c).sum() * scale``: each grad is ``c * scale``, exact for a power-of-two scale, so the
scaled grads are exactly the unscaled ones times the scale, over params of many 4,096-element rows (more rows
than the norm stage rescues one by one). Paths: the unfolded norm, the norm folded in backward hooks, the
captured step; fp32, bf16 and fp16 grads; graphstep's own loss scale and torch's GradScaler.
"""

import math

import pytest
import torch
from toy import grad_scaler

import graphstep as gs
from graphstep.step.stages.norm import RESCUE_ROWS, ROW

ROWS = 4 * RESCUE_ROWS  # per param: more overflowing rows than the rescue takes
EXTREME = [2.0**-126, 2.0**-100, 2.0**-64, 2.0**68, 2.0**100, 2.0**124, 2.0**127]


def scale_id(scale):
    return f"2^{int(math.log2(scale))}"


class Weights(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(ROWS * ROW + 5, dtype=dtype))
        self.b = torch.nn.Parameter(torch.zeros(ROWS * ROW // 2 + 7, dtype=dtype))


def coefficients(scale, seed=0, dtype=torch.float32):
    """Unscaled grads of about 1e-3 (about 1e3 at 2**-126, so that the scaled grads stay normal numbers), a
    few ten times larger, all exactly representable in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 1e3 if scale < 2.0**-110 else 1e-3
    out = []
    for numel in (ROWS * ROW + 5, ROWS * ROW // 2 + 7):
        c = torch.randn(numel, generator=g) * magnitude
        c[::97] *= 30
        out.append(c.to(dtype))
    return out


def oracle_norm(coeffs) -> float:
    grads = [torch.nn.Parameter(torch.zeros(c.shape)) for c in coeffs]
    for p, c in zip(grads, coeffs):
        p.grad = c.float().clone()
    return float(torch.nn.utils.clip_grad_norm_(grads, 1.0))


def engine(dtype=torch.float32, *, loss_scale=None, fold=True, capture="eager", **changes):
    model = Weights(dtype)
    precision = {torch.float32: {}, torch.bfloat16: dict(bf16=True, main_grads_dtype=torch.bfloat16),
                 torch.float16: dict(fp16=True, main_grads_dtype=torch.float16)}[dtype]
    fields = dict(optimizer="sgd", lr=0.0, clip_grad=1.0, loss_scale=loss_scale, kernel="fused", capture=capture,
                  capture_warmup_steps=1, fold_grad_norm=fold, **precision)
    config = gs.OptimizerConfig(**{**fields, **changes})
    return model, gs.get_optimizer(config, model, config_overrides={})


def loss_of(model, coeffs):
    return sum((p * c.to(p.dtype)).sum() for p, c in zip(model.parameters(), coeffs))


def unscaled_norm(coeffs, dtype=torch.float32, **changes) -> float:
    """The same engine's norm without a loss scale."""
    model, opt = engine(dtype, **changes)
    norm, = own_scale_norms(model, opt, coeffs)
    return norm


def own_scale_norms(model, opt, coeffs, steps=1):
    norms = []
    for _ in range(steps):
        opt.scale_loss(loss_of(model, coeffs)).backward()
        result = opt.step()
        assert bool(result.update_successful), "a step of finite grads was skipped"
        norms.append(float(result.grad_norm))
        opt.zero_grad()
    return norms


@pytest.mark.parametrize("scale", EXTREME, ids=scale_id)
@pytest.mark.parametrize("fold", [True, False], ids=["folded", "unfolded"])
@pytest.mark.small_fold_units
def test_norm_under_an_extreme_own_loss_scale_is_clip_grad_norm_s_of_the_unscaled_grads(fold, scale):
    coeffs = coefficients(scale)
    model, opt = engine(loss_scale=scale, fold=fold)
    norm, = own_scale_norms(model, opt, coeffs)
    if fold:
        assert opt.fold_counts["in_backward"] > 0, "the backward hooks folded nothing: the test misses their path"
    assert norm == pytest.approx(oracle_norm(coeffs), rel=1e-6)
    assert norm == unscaled_norm(coeffs, fold=fold), "not the bits of the norm without a loss scale"


@pytest.mark.parametrize("scale", [2.0**-100, 2.0**100, 2.0**127], ids=scale_id)
def test_bf16_grads_under_an_extreme_loss_scale_give_clip_grad_norm_s_norm(scale):
    coeffs = coefficients(scale, dtype=torch.bfloat16)
    model, opt = engine(torch.bfloat16, loss_scale=scale)
    norm, = own_scale_norms(model, opt, coeffs)
    # clip_grad_norm_'s fp32 sum over whole params is itself 2e-6 off an fp64 sum here; graphstep's rows, 2e-7.
    assert norm == pytest.approx(oracle_norm(coeffs), rel=5e-6)
    assert norm == unscaled_norm(coeffs, torch.bfloat16), "not the bits of the norm without a loss scale"


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**-8, 2.0**8], ids=scale_id)
def test_fp16_grads_are_normed_as_they_come_and_never_pushed_out_of_fp16s_range(scale):
    # An fp16 grad's square always fits fp32; dividing fp16 grads by a power of two could overflow them (a grad
    # of 3e4 under a scale of 2**-20 is 0.03 in fp16, and 3e4 again once unscaled: near fp16's top).
    g = torch.Generator().manual_seed(3)
    coeffs = [torch.randn(ROWS * ROW + 5, generator=g) * 0.5, torch.randn(ROWS * ROW // 2 + 7, generator=g) * 0.5]
    coeffs[0][7] = 6e4 / max(scale, 1.0)  # near fp16's top, scaled or not
    coeffs = [(c.half().float() * scale).half().float() / scale for c in coeffs]  # what fp16 holds of them
    model, opt = engine(torch.float16, loss_scale=scale)
    norm, = own_scale_norms(model, opt, coeffs)
    assert norm == pytest.approx(oracle_norm(coeffs), rel=1e-6)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("scale", EXTREME, ids=scale_id)
def test_norm_under_an_extreme_grad_scaler_is_clip_grad_norm_s_from_its_first_step(scale):
    coeffs = coefficients(scale)
    model, opt = engine()
    amp = grad_scaler(scale)
    for step in range(3):  # the first step (no earlier scale to go by) and the later ones
        amp.scale(loss_of(model, coeffs)).backward()
        amp.step(opt)
        amp.update()
        assert bool(opt.result.update_successful), f"step {step}: a step of finite grads was skipped"
        assert float(opt.result.grad_norm) == pytest.approx(oracle_norm(coeffs), rel=1e-6), f"step {step}"
        opt.zero_grad()
    assert amp.get_scale() == scale


def test_grad_scaler_unscale_then_clip_under_an_extreme_scale_keeps_the_norm():
    # scaler.unscale_(opt) between GradScaler steps: the grads come unscaled, then scaled again next step.
    coeffs = coefficients(2.0**120)
    model, opt = engine()
    amp = grad_scaler(2.0**120)
    for step, unscale in enumerate([False, True, False]):
        amp.scale(loss_of(model, coeffs)).backward()
        if unscale:
            amp.unscale_(opt)
        amp.step(opt)
        amp.update()
        assert float(opt.result.grad_norm) == pytest.approx(oracle_norm(coeffs), rel=1e-6), f"step {step}"
        opt.zero_grad()


def test_a_grad_scaler_scale_forced_far_down_between_steps_skips_instead_of_clipping_wrong():
    # The backward's folds go by the scale of the last step; a scale the user set 2**110 lower since would
    # make the scaled grads' squares underflow there: the step is skipped, never clipped by a wrong norm.
    coeffs = coefficients(2.0**120)
    model, opt = engine()
    amp = grad_scaler(2.0**120)
    norms = []
    for new_scale in (None, 2.0**10, None, None):  # the second update sets the third step's scale
        amp.scale(loss_of(model, coeffs)).backward()
        amp.step(opt)
        amp.update(new_scale)
        norms.append(float(opt.result.grad_norm) if bool(opt.result.update_successful) else None)
        opt.zero_grad()
    expected = oracle_norm(coeffs)
    assert norms[0] == pytest.approx(expected, rel=1e-6)
    assert norms[1] == pytest.approx(expected, rel=1e-6)
    assert norms[2] is None or norms[2] == pytest.approx(expected, rel=1e-6)
    assert norms[3] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("scale", [2.0**-100, 2.0**127], ids=scale_id)
@pytest.mark.small_fold_units
def test_the_fold_leaves_the_grads_as_backward_wrote_them(scale):
    coeffs = coefficients(scale)
    model, opt = engine(loss_scale=scale)
    opt.scale_loss(loss_of(model, coeffs)).backward()
    assert opt.fold_counts["in_backward"] > 0
    for p, c in zip(model.parameters(), coeffs):
        assert torch.equal(p.grad, c * scale), "the backward fold changed the grads"


@pytest.mark.parametrize("scale", [2.0**-100, 2.0**127], ids=scale_id)
@pytest.mark.parametrize("fold", [True, False], ids=["folded", "unfolded"])
def test_captured_step_under_an_extreme_scale_equals_eager_bitwise(fold, scale):
    coeffs = coefficients(scale)
    runs = {}
    for capture in ("eager", "graph"):
        model, opt = engine(loss_scale=scale, fold=fold, capture=capture, clip_grad=1e-3, lr=0.1)
        norms = own_scale_norms(model, opt, coeffs, steps=4)
        if capture == "graph":
            assert opt.captured, "the step was not captured"
        runs[capture] = (norms, [p.detach().clone() for p in model.parameters()])
    assert runs["graph"][0] == runs["eager"][0]
    assert runs["graph"][0][-1] == pytest.approx(oracle_norm(coeffs), rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(runs["graph"][1], runs["eager"][1]))


def test_a_constant_scale_loaded_outside_the_band_recaptures_and_norms_right():
    # A constant scale inside the band costs the step no call (a host fact); a loaded one outside it flips that
    # choice, which the captured step must not keep.
    coeffs = coefficients(2.0**120)
    model, opt = engine(loss_scale=2.0**10, capture="graph")
    norms = own_scale_norms(model, opt, coeffs, steps=3)
    assert opt.captured
    opt.scaler.load_state_dict({"scale": 2.0**120})
    norms += own_scale_norms(model, opt, coeffs, steps=3)
    assert opt.recaptures == 1
    assert norms == pytest.approx([oracle_norm(coeffs)] * 6, rel=1e-6)
