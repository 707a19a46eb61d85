"""Loss scales at the ends of the range the config accepts, under clipping: the unscale and the clip coefficient,
folded into the factor the update divides the grads by, must neither overflow nor underflow it.

Oracle: torch.optim on the unscaled grads after ``clip_grad_norm_`` (the families torch has no optimizer for:
the same graphstep step without a loss scale). graphstep's own scaler (``loss_scale``) and torch's GradScaler
(``scaler.step(opt)`` handing its scale to the step). Models of one 4,096-element row and a tail, and wider ones
of eight rows, more than the norm's rescue takes one by one: their scaled grads' row sums of squares overflow fp32
under a large scale and underflow under a tiny one unless the norm divides them by the scale's power of two first
(graphstep/step/norm_prescale.py).
"""

import pytest
import torch

import graphstep as gs
from toy import backward_and_step, grad_scaler, relative_drift

LR, CLIP, STEPS = 1e-2, 0.01, 3  # clip coefficients of about 0.02: the full factor passes fp32 max from 2**123
LARGE_SCALES = [2.0**124, 2.0**125, 2.0**126, 2.0**127]
TINY_SCALES = [2.0**-20, 2.0**-40]


def model_and_data(seed=0, width=64):
    torch.manual_seed(seed)
    model = torch.nn.Linear(width, 64)
    g = torch.Generator().manual_seed(7)
    data = [torch.randn(8, width, generator=g) for _ in range(STEPS)]
    return model, data


def loss_of(model, inputs):
    # Grads of about 0.1 to 1: finite times 2**127.
    return model(inputs).square().mean()


def torch_run(optimizer: str, clip: float, width=64):
    model, data = model_and_data(width=width)
    start = [p.detach().clone() for p in model.parameters()]
    if optimizer == "adam":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=0.1, momentum=0.9)  # sgd_momentum's default
    for inputs in data:
        loss_of(model, inputs).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model, start


def graphstep_run(optimizer: str, kernel: str, *, loss_scale=None, amp_scale=None, clip=CLIP, width=64, **extra):
    model, data = model_and_data(width=width)
    config = gs.OptimizerConfig(optimizer=optimizer, lr=LR, weight_decay=0.1, clip_grad=clip, loss_scale=loss_scale,
                                kernel=kernel, capture="eager", **extra)
    opt = gs.get_optimizer(config, model, config_overrides={})
    amp = grad_scaler(amp_scale)
    for inputs in data:
        backward_and_step(opt, loss_of(model, inputs), amp)
        assert bool(opt.result.update_successful), f"loss scale {loss_scale or amp_scale}: a finite step was skipped"
        opt.zero_grad()
    if amp is not None:
        assert amp.get_scale() == amp_scale  # no step found non-finite by torch's check
    return model


def _assert_tracks(model, reference, start, what, bound):
    drift = relative_drift(list(model.parameters()), list(reference.parameters()), start)
    assert drift < bound, f"{what}: drift {drift:.3g} of the motion from the oracle (bound {bound})"


# Measured without any loss scale: 1.6e-7 (Adam) and 1.0e-6 (SGD, reference kernel); Adam turns last-bit
# differences of the clip coefficient into more drift than SGD (docs/design.md §8).
BOUNDS = {"adam": 1e-4, "sgd": 1e-5}


@pytest.mark.parametrize("scale", LARGE_SCALES + TINY_SCALES, ids=lambda s: f"2^{int(torch.tensor(s).log2())}")
@pytest.mark.parametrize("kernel", ["fused", "reference"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_own_loss_scale_at_the_ends_of_its_range_clips_as_torch_does_on_unscaled_grads(optimizer, kernel, scale):
    reference, start = torch_run(optimizer, CLIP)
    model = graphstep_run(optimizer, kernel, loss_scale=scale)
    _assert_tracks(model, reference, start, f"{optimizer}/{kernel} at loss scale {scale:g}", BOUNDS[optimizer])


@pytest.mark.parametrize("scale", LARGE_SCALES + TINY_SCALES, ids=lambda s: f"2^{int(torch.tensor(s).log2())}")
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_torch_grad_scaler_at_the_ends_of_its_range_clips_as_torch_does_on_unscaled_grads(optimizer, scale):
    reference, start = torch_run(optimizer, CLIP)
    model = graphstep_run(optimizer, "fused", amp_scale=scale)
    _assert_tracks(model, reference, start, f"{optimizer} under GradScaler at {scale:g}", BOUNDS[optimizer])


# Eight 4,096-element rows of weights (and a tail of biases): under 2**124 to 2**127 every row's fp32 sum of squares
# overflows, under 2**-100 the squares underflow (the backward itself is exact there down to about 2**-120).
WIDE = 512
WIDE_SCALES = [2.0**-100, 2.0**124, 2.0**125, 2.0**126, 2.0**127]


@pytest.mark.parametrize("scale", WIDE_SCALES, ids=lambda s: f"2^{int(torch.tensor(s).log2())}")
@pytest.mark.parametrize("scaler", ["own", "GradScaler"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_many_rows_under_an_extreme_scale_clip_as_torch_does_on_unscaled_grads(optimizer, scaler, scale):
    reference, start = torch_run(optimizer, CLIP, width=WIDE)
    scales = dict(loss_scale=scale) if scaler == "own" else dict(amp_scale=scale)
    model = graphstep_run(optimizer, "fused", width=WIDE, **scales)
    _assert_tracks(model, reference, start, f"{optimizer}, {scaler} loss scale {scale:g}, {WIDE * 64} weights",
                   BOUNDS[optimizer])


def test_the_repro_moves_the_weights_by_the_learning_rate():
    # nn.Linear(64, 64), Adam, clip 0.1, loss scale 2**127: the first step moves each weight by about lr.
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    start = model.weight.detach().clone()
    config = gs.OptimizerConfig(lr=1e-2, clip_grad=0.1, loss_scale=2.0**127, kernel="fused", capture="eager")
    opt = gs.get_optimizer(config, model, config_overrides={})
    opt.scale_loss(model(torch.randn(8, 64)).square().mean()).backward()
    opt.step()
    moved = (model.weight.detach() - start).abs().max().item()
    assert 0.9e-2 < moved < 1.1e-2, f"the weights moved {moved:.3g}, not about lr = 1e-2"


# A power-of-two loss scale multiplies every intermediate of the backward, the grads' sums of squares (rows
# whose fp32 norm overflows are recomputed scaled by a power of two) and the clip stage's products exactly:
# the unscaled, clipped grads the kernel computes are then the bits of a run without a loss scale, and so is
# everything after them. That holds for every family and kernel, with the factor split or not.
FAMILY_KERNELS = [("adam", "fused"), ("adam", "reference"), ("sgd", "fused"), ("sgd", "reference"),
                  ("lion", "auto"), ("ademamix", "auto"), ("muon", "auto")]


def family_run(optimizer, kernel, *, loss_scale=None, amp_scale=None, capture="eager", steps=STEPS,
               inf_step=None):
    model, data = model_and_data()
    data = (data * steps)[:steps]
    config = gs.OptimizerConfig(optimizer=optimizer, lr=LR, weight_decay=0.1, clip_grad=CLIP, loss_scale=loss_scale,
                                kernel=kernel, capture=capture, capture_warmup_steps=1)
    opt = gs.get_optimizer(config, model, config_overrides={})
    amp = grad_scaler(amp_scale)
    for step, inputs in enumerate(data):
        backward_and_step(opt, loss_of(model, inputs) * (float("inf") if step == inf_step else 1.0), amp)
        opt.zero_grad()
    return model, opt


def _assert_bitwise(model, reference, what):
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        if not torch.equal(a, b):
            far = (a - b).abs().max().item()
            raise AssertionError(f"{what}: {name} differs from the run without a loss scale by up to {far:.3g}")


@pytest.mark.parametrize("scale", [2.0**-40, 2.0**124, 2.0**127], ids=lambda s: f"2^{int(torch.tensor(s).log2())}")
@pytest.mark.parametrize("optimizer,kernel", FAMILY_KERNELS, ids=lambda v: v)
def test_every_family_and_kernel_under_an_extreme_power_of_two_scale_is_the_unscaled_run_bitwise(optimizer, kernel,
                                                                                                 scale):
    reference, _ = family_run(optimizer, kernel)
    model, _ = family_run(optimizer, kernel, loss_scale=scale)
    _assert_bitwise(model, reference, f"{optimizer}/{kernel}, loss scale {scale:g}")


@pytest.mark.parametrize("optimizer,kernel", [("adam", "fused"), ("muon", "auto")], ids=lambda v: v)
def test_grad_scaler_at_2_127_is_the_unscaled_run_bitwise(optimizer, kernel):
    reference, _ = family_run(optimizer, kernel)
    model, _ = family_run(optimizer, kernel, amp_scale=2.0**127)
    _assert_bitwise(model, reference, f"{optimizer}/{kernel} under GradScaler at 2**127")


@pytest.mark.auto_as_large
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_compiled_kernel_under_2_127_is_the_unscaled_run_bitwise(optimizer):
    reference, _ = family_run(optimizer, "compiled")
    model, _ = family_run(optimizer, "compiled", loss_scale=2.0**127)
    _assert_bitwise(model, reference, f"{optimizer}/compiled, loss scale 2**127")


def test_replay_with_a_split_factor_and_a_skipped_step_equals_eager_bitwise():
    # The pre-division runs or returns on the device's flag, so one captured graph serves the split and the
    # skipped step alike.
    eager, eager_opt = family_run("adam", "fused", loss_scale=2.0**127, steps=6, inf_step=3)
    replayed, opt = family_run("adam", "fused", loss_scale=2.0**127, capture="graph", steps=6, inf_step=3)
    assert opt.captured, "the step was not captured"
    _assert_bitwise(replayed, eager, "replay against eager at loss scale 2**127")
