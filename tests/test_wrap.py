"""graphstep.wrap: a user's torch optimizer captured on the CPU replay backend, against it unwrapped."""

import io

import pytest
import torch
from toy import decay_groups, loss_fn, tiny_transformer

import capture
import graphstep as gs
from graphstep.step.scaler import DynamicLossScaler


def lambda_lr(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))


def train(model, opt, sched, steps=50):
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()
        sched.step()


def test_wrapped_fused_adamw_is_bitwise_equal_to_unwrapped_under_lambdalr():
    plain_model, wrapped_model = tiny_transformer(), tiny_transformer()
    plain = torch.optim.AdamW(decay_groups(plain_model, 0.1), lr=3e-3, fused=True)
    wrapped = gs.wrap(torch.optim.AdamW(decay_groups(wrapped_model, 0.1), lr=3e-3, fused=True), warmup=2)
    train(plain_model, plain, lambda_lr(plain))
    train(wrapped_model, wrapped, lambda_lr(wrapped))
    assert wrapped.captured
    for a, b in zip(plain_model.parameters(), wrapped_model.parameters()):
        assert torch.equal(a, b)


def test_the_same_step_captured_with_a_float_lr_would_freeze():
    plain_model, frozen_model = tiny_transformer(), tiny_transformer()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=3e-3, fused=True)
    # capturable=True: what torch requires to capture the step at all (see the next test)
    frozen = torch.optim.AdamW(frozen_model.parameters(), lr=3e-3, fused=True, capturable=True)
    plain_sched, frozen_sched = lambda_lr(plain), lambda_lr(frozen)
    graph = capture.graph(frozen.step, warmup=2, backend="replay")  # no lr conversion: a float lr
    for step in range(20):
        for model, opt, sched, run in ((plain_model, plain, plain_sched, plain.step),
                                       (frozen_model, frozen, frozen_sched, graph)):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            loss_fn(model, step).backward()
            run()
            sched.step()
    assert not all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), frozen_model.parameters()))


def test_a_fused_adamw_without_capturable_is_refused_as_a_cuda_capture_would_refuse_it():
    # torch's Adam.step raises under a CUDA capture when a group has capturable=False, fused or not; the
    # replay backend applies that rule on the CPU too, and wrap marks its fused groups capturable.
    model = tiny_transformer()
    raw = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    graph = capture.graph(raw.step, warmup=1, backend="replay")
    loss_fn(model, 0).backward()
    graph()  # warm-up: eager, no capture yet
    with pytest.raises(capture.CaptureError, match="capturable=False") as refused:
        graph()
    assert [f.kind for f in refused.value.findings] == ["not_capturable"]

    wrapped = gs.wrap(torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True))
    assert_captures(wrapped, model)


def assert_captures(wrapped, model) -> None:
    """Every group of ``wrapped`` is capturable and its step is captured after the warm-up."""
    assert all(group["capturable"] for group in wrapped.param_groups)
    for step in range(3):
        loss_fn(model, step).backward()
        wrapped.step()
    assert wrapped.captured


def test_a_state_dict_saved_without_capturable_still_captures_after_loading():
    source_model, model = tiny_transformer(), tiny_transformer()
    source = torch.optim.AdamW(source_model.parameters(), lr=3e-3, fused=True)  # capturable=False
    loss_fn(source_model, 0).backward()
    source.step()
    wrapped = gs.wrap(torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True))
    wrapped.load_state_dict(source.state_dict())
    assert_captures(wrapped, model)


def test_wrapped_sgd_and_the_users_set_to_none_zero_grad():
    plain_model, wrapped_model = tiny_transformer(), tiny_transformer()
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.05, momentum=0.9, fused=True)
    wrapped = gs.wrap(torch.optim.SGD(wrapped_model.parameters(), lr=0.05, momentum=0.9, fused=True))
    for step in range(20):
        for model, opt in ((plain_model, plain), (wrapped_model, wrapped)):
            model.zero_grad(set_to_none=True)  # new grad tensors every backward
            loss_fn(model, step).backward()
            opt.step()
    assert wrapped.captured
    for a, b in zip(plain_model.parameters(), wrapped_model.parameters()):
        assert torch.equal(a, b)


def test_a_weight_decay_change_recaptures_instead_of_freezing():
    plain_model, wrapped_model = tiny_transformer(), tiny_transformer()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=3e-3, fused=True)
    wrapped = gs.wrap(torch.optim.AdamW(wrapped_model.parameters(), lr=3e-3, fused=True))
    for step in range(12):
        for model, opt in ((plain_model, plain), (wrapped_model, wrapped)):
            opt.param_groups[0]["weight_decay"] = 0.01 * (1 + step // 4)
            opt.zero_grad()
            loss_fn(model, step).backward()
            opt.step()
    assert wrapped.recaptures == 2
    for a, b in zip(plain_model.parameters(), wrapped_model.parameters()):
        assert torch.equal(a, b)


def test_graphsteps_scaler_skips_non_finite_steps_on_device():
    model = tiny_transformer()
    scaler = DynamicLossScaler(initial_scale=2.0**10, min_scale=1.0, growth_interval=100, hysteresis=1,
                               device=torch.device("cpu"))
    wrapped = gs.wrap(torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True), scaler=scaler, warmup=2)
    for step in range(6):
        wrapped.zero_grad()
        wrapped.scale_loss(loss_fn(model, step)).backward()
        if step == 4:
            before = [p.detach().clone() for p in model.parameters()]
            next(model.parameters()).grad[0, 0] = float("inf")
        wrapped.step()
        if step == 4:
            assert not wrapped.update_successful.item()
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            assert scaler.scale.item() == 2.0**9
    assert wrapped.captured
    assert next(iter(wrapped.state.values()))["step"].item() == 5  # the skipped step did not count


@pytest.mark.parametrize("make, reason", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "reads the step count on the host"),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True), "reads the step count on the host"),
    (lambda ps: torch.optim.SGD(ps, lr=1e-3), "lr would freeze"),
    (lambda ps: torch.optim.Adagrad(ps, lr=1e-3), "not one of Adam, AdamW, SGD"),
])
def test_settings_that_would_freeze_are_refused(make, reason):
    with pytest.raises(ValueError, match=reason):
        gs.wrap(make(tiny_transformer().parameters()))


def test_state_dict_round_trip_keeps_the_schedule_live():
    # accelerate (and so transformers.Trainer) calls load_state_dict(state_dict()) when it prepares the
    # optimizer; a scheduler built before must keep driving the lr the captured step reads.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    reference = torch.nn.Linear(8, 8)
    reference.load_state_dict(model.state_dict())
    wrapped = gs.wrap(torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    plain = torch.optim.AdamW(reference.parameters(), lr=0.1, fused=True)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: (k + 1) / 10) for o in (wrapped, plain)]
    wrapped.load_state_dict(wrapped.state_dict())
    assert wrapped.optimizer.param_groups is wrapped.param_groups
    for step in range(6):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, wrapped), (reference, plain)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
        for s in schedules:
            s.step()
        if step == 3:
            wrapped.load_state_dict(wrapped.state_dict())  # a resume mid-run, after capture
    assert float(wrapped.param_groups[0]["lr"]) == plain.param_groups[0]["lr"]
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_baked_value_is_still_guarded_after_a_moved_input_forced_a_recapture():
    # The recapture after a moved static input must record the baked values anew; otherwise a later
    # weight-decay change would replay the old value forever.
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    reference.load_state_dict(model.state_dict())
    wrapped = gs.wrap(torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, fused=True))
    plain = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    for step in range(8):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        if step == 3:
            for m in (model, reference):
                m.weight.data = m.weight.data.clone()  # a static input moves
        if step == 5:
            for o in (wrapped, plain):
                o.param_groups[0]["weight_decay"] = 0.5  # a baked value changes
        for m, o in ((model, wrapped), (reference, plain)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    assert wrapped.recaptures == 2
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_a_param_frozen_after_wrapping_is_refused_by_name():
    # torch's SGD would skip the frozen param (its grad is None after zero_grad); the captured step reads a
    # static zero grad instead, and momentum would go on moving the param.
    model = tiny_transformer()
    wrapped = gs.wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True))
    for step in range(2):
        model.zero_grad(set_to_none=True)
        loss_fn(model, step).backward()
        wrapped.step()
    first = next(model.parameters())
    first.requires_grad_(False)
    model.zero_grad(set_to_none=True)
    loss_fn(model, 2).backward()
    before = first.detach().clone()
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\]' do not require grad"):
        wrapped.step()
    assert torch.equal(before, first)


def _scaled(seed):
    model = tiny_transformer(seed=seed)
    scaler = DynamicLossScaler(initial_scale=2.0**10, min_scale=1.0, growth_interval=2, hysteresis=2,
                               device=torch.device("cpu"))
    return model, gs.wrap(torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True), scaler=scaler)


def _scaled_steps(model, wrapped, steps):
    for step in steps:
        wrapped.zero_grad()
        wrapped.scale_loss(loss_fn(model, step) * (float("inf") if step in (2, 3) else 1.0)).backward()
        wrapped.step()


def test_a_resume_brings_the_loss_scalers_state_back_and_is_bitwise_the_uninterrupted_run():
    # Two overflows (hysteresis 2) and growth: the scale and both trackers differ from the initial ones.
    model, wrapped = _scaled(0)
    _scaled_steps(model, wrapped, range(6))
    saved = torch.load(_round_trip({"model": model.state_dict(), "opt": wrapped.state_dict()}), weights_only=True)
    assert saved["opt"]["scaler"]["scale"].item() != 2.0**10
    _scaled_steps(model, wrapped, range(6, 10))
    resumed_model, resumed = _scaled(1)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["opt"])
    _scaled_steps(resumed_model, resumed, range(6, 10))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))


def test_a_state_dict_without_the_scalers_state_is_refused_by_a_scaled_wrap():
    model, wrapped = _scaled(0)
    _scaled_steps(model, wrapped, range(1))
    plain = gs.wrap(torch.optim.AdamW(tiny_transformer().parameters(), lr=3e-3, fused=True))
    with pytest.raises(ValueError, match="no loss-scaler state"):
        wrapped.load_state_dict({k: v for k, v in wrapped.state_dict().items() if k != "scaler"})
    with pytest.raises(ValueError, match="has no scaler= to take it"):
        plain.load_state_dict(wrapped.state_dict())


def _round_trip(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer
