"""torch's GradScaler stepping the engine (graphstep/step/torch_amp.py), against torch's fused AdamW under the same
scaler: the recipe with and without ``scaler.unscale_(opt)``, clipping by graphstep or by the user, skipped
steps, capture, and the refusals where graphstep scales the loss itself."""

import pytest
import torch

import graphstep as gs
from toy import relative_drift

LR, WD, CLIP = 1e-2, 0.1, 0.5
INF_STEPS = (3, 9)  # steps whose loss is made non-finite: both scalers skip them and back off


def model_and_data(seed=0):
    # Params of at least one 4,096-element row, so the folded norm's backward hooks fold them.
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    g = torch.Generator().manual_seed(123)
    data = [(torch.randn(16, 64, generator=g), torch.randn(16, 64, generator=g)) for _ in range(14)]
    return model, data


def scaler():
    # A small growth interval, so the scale also grows within the run.
    return torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=4)


def loss_of(model, step, data):
    inputs, targets = data[step]
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    return loss * float("inf") if step in INF_STEPS else loss


def train(model, data, opt, amp, *, unscale: bool, user_clip: float = 0.0):
    """torch's AMP recipe; returns the GradScaler's scale after each step."""
    scales = []
    for step in range(len(data)):
        amp.scale(loss_of(model, step, data)).backward()
        if unscale:
            amp.unscale_(opt)
        if user_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), user_clip)
        amp.step(opt)
        amp.update()
        opt.zero_grad()
        scales.append(amp.get_scale())
    return scales


def torch_run(unscale: bool, clip: float):
    model, data = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    start = [p.detach().clone() for p in model.parameters()]
    scales = train(model, data, opt, scaler(), unscale=unscale or clip > 0, user_clip=clip)
    return model, start, scales


def graphstep_run(unscale: bool, clip: float = 0.0, user_clip: float = 0.0, capture="eager"):
    model, data = model_and_data()
    config = gs.OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=clip, capture=capture, kernel="fused")
    opt = gs.get_optimizer(config, model, config_overrides={})
    scales = train(model, data, opt, scaler(), unscale=unscale, user_clip=user_clip)
    return model, opt, scales


@pytest.mark.parametrize("unscale", [False, True], ids=["scaler.step", "unscale_+step"])
def test_unclipped_amp_step_is_torch_fused_adamw_bitwise(unscale):
    reference, _, torch_scales = torch_run(unscale, clip=0.0)
    model, opt, scales = graphstep_run(unscale)
    assert scales == torch_scales and scales[INF_STEPS[0]] < scales[INF_STEPS[0] - 1]  # backed off on the inf step
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("unscale", [False, True], ids=["scaler.step", "unscale_+step"])
@pytest.mark.small_fold_units
def test_graphsteps_clip_under_amp_tracks_torchs_unscale_and_clip_grad_norm(unscale):
    # torch: unscale_, clip_grad_norm_, fused AdamW; graphstep: its own clip_grad inside the step. With
    # unscale_ the grads are unscaled in place without a version bump: the folded norm must be refolded,
    # else the clip coefficient comes from the scaled norm (clipping ~4,096x too hard here).
    reference, start, torch_scales = torch_run(unscale, clip=CLIP)
    model, opt, scales = graphstep_run(unscale, clip=CLIP)
    assert scales == torch_scales
    assert opt.fold_counts["in_backward"] > 0  # the hooks did fold: the refold is what keeps the norm right
    # The same clip factor, applied in the kernel instead of on the grads: last-bit differences (docs/design.md §8).
    assert relative_drift(list(model.parameters()), list(reference.parameters()), start) < 1e-5
    clipped = opt.result.grad_norm.item()
    assert 0 < clipped < float("inf")


def test_users_clip_after_unscale_tracks_torch():
    # The user clips the unscaled grads themselves (graphstep's clip_grad off): torch's clip_grad_norm_ bumps the
    # version counters, unscale_ does not; both must be seen.
    reference, start, torch_scales = torch_run(True, clip=CLIP)
    model, _, scales = graphstep_run(True, user_clip=CLIP)
    assert scales == torch_scales
    assert relative_drift(list(model.parameters()), list(reference.parameters()), start) < 1e-5


def test_grad_norm_is_the_unscaled_norm_under_amp():
    model, data = model_and_data()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=LR, capture="eager", kernel="fused"), model, config_overrides={})
    amp = scaler()
    amp.scale(loss_of(model, 0, data)).backward()
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])) / amp.get_scale()
    amp.step(opt)
    assert torch.allclose(opt.result.grad_norm, expected, rtol=1e-6)
    assert opt.result.update_successful.item()


def test_torchs_found_inf_skips_the_step_even_when_the_grads_are_finite_again():
    # The protocol's flag decides, as for torch's own fused optimizers: grads the user sanitised after
    # unscale_ found an inf are still skipped, and the GradScaler backs off.
    model, data = model_and_data()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=LR, capture="eager", kernel="fused"), model, config_overrides={})
    before = [p.detach().clone() for p in model.parameters()]
    amp = scaler()
    amp.scale(loss_of(model, INF_STEPS[0], data)).backward()
    amp.unscale_(opt)
    for p in model.parameters():
        p.grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    amp.step(opt)
    amp.update()
    assert not opt.result.update_successful.item()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    # The next step without a GradScaler runs unscaled and reports nothing.
    loss_of(model, 0, data).backward()
    opt.step()
    assert opt.result.update_successful.item() and not torch.equal(next(model.parameters()), before[0])


def test_captured_amp_step_replays_equal_to_eager():
    eager_model, _, eager_scales = graphstep_run(True, clip=CLIP)
    graph_model, graph_opt, graph_scales = graphstep_run(True, clip=CLIP, capture="graph")
    assert graph_opt.captured and graph_opt.recaptures == 0
    assert eager_scales == graph_scales
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("setting", [dict(fp16=True), dict(loss_scale=1024.0)], ids=["fp16", "loss_scale"])
def test_a_gradscaler_on_an_engine_that_scales_the_loss_itself_is_refused(setting):
    model, data = model_and_data()
    if setting.get("fp16"):
        model.half()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=LR, capture="eager", kernel="fused", **setting), model,
                           config_overrides={})
    before = [p.detach().clone() for p in model.parameters()]
    inputs, targets = data[0]
    loss = torch.nn.functional.mse_loss(model(inputs.to(before[0].dtype)).float(), targets)
    amp = scaler()
    amp.scale(loss).backward()
    with pytest.raises(RuntimeError, match="scales the loss itself"):
        amp.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
