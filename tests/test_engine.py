"""The engine against torch.optim: parity, schedulers, static buffers, checkpoints, bad input."""

import functools

import pytest
import torch

import graphstep as gs
from _engine import make_engine
from _auto_kernel import assert_compiled_unless_inductor_cannot_compile
from _parity import assert_bitwise
from toy import decay_groups, loss_fn, relative_drift, relative_error, tiny_transformer

STEPS = 50


def train(model, opt, steps, start=0, scheduler=None):
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


# The oracle, torch.optim, does not clip: here the engine is unclipped unless a test clips.
engine = functools.partial(make_engine, clip_grad=0.0)


ADAM = dict(lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95)


def test_adamw_fp32_is_bitwise_equal_to_torch_fused_adamw():
    ours, theirs = tiny_transformer(), tiny_transformer()
    opt = engine(ours, **ADAM)
    assert len(opt.param_groups) == 2
    ref = torch.optim.AdamW(decay_groups(theirs, 0.1), lr=3e-3, betas=(0.9, 0.95), fused=True)
    train(ours, opt, STEPS)
    train(theirs, ref, STEPS)
    assert_bitwise(ours.named_parameters(), theirs.parameters(), step=STEPS, against="torch's fused AdamW")


def test_adam_with_l2_decay_is_bitwise_equal_to_torch_fused_adam():
    ours, theirs = tiny_transformer(), tiny_transformer()
    opt = engine(ours, decoupled_weight_decay=False, **ADAM)
    ref = torch.optim.Adam(decay_groups(theirs, 0.1), lr=3e-3, betas=(0.9, 0.95), fused=True)
    train(ours, opt, 20)
    train(theirs, ref, 20)
    assert_bitwise(ours.named_parameters(), theirs.parameters(), step=20, against="torch's fused Adam")


@pytest.mark.parametrize("decoupled", [True, False])
def test_compiled_kernel_drifts_from_torch_fused_adam_no_more_than_torchs_own_for_loop(decoupled):
    # Its own loop, so not bitwise: Adam turns last-bit differences into drift (docs/design.md §8). The
    # yardstick is torch's own for-loop Adam against torch's fused one, over the same steps.
    ours, fused, loop = tiny_transformer(), tiny_transformer(), tiny_transformer()
    start = [p.detach().clone() for p in fused.parameters()]
    kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    train(ours, engine(ours, kernel="compiled", decoupled_weight_decay=decoupled, **ADAM), STEPS)
    train(fused, kind(decay_groups(fused, 0.1), lr=3e-3, betas=(0.9, 0.95), fused=True), STEPS)
    train(loop, kind(decay_groups(loop, 0.1), lr=3e-3, betas=(0.9, 0.95), foreach=False), STEPS)
    ours_drift = relative_drift(list(ours.parameters()), list(fused.parameters()), start)
    torch_drift = relative_drift(list(loop.parameters()), list(fused.parameters()), start)
    assert ours_drift < 1.5 * torch_drift and ours_drift < 3e-3


def _train_torch_clipped_scaled(model, opt, steps, scale, clip):
    # torch's AMP recipe with a constant scale: backward of loss * scale, unscale, clip_grad_norm_, step.
    params = [p for p in model.parameters()]
    for step in range(steps):
        opt.zero_grad()
        (loss_fn(model, step) * scale).backward()
        for p in params:
            p.grad.div_(scale)
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()


@pytest.mark.auto_as_large
def test_default_step_with_clip_and_loss_scale_drifts_from_torch_amp_no_more_than_torchs_own_for_loop():
    # The default kernel ("auto") is "compiled" here (or "fused" where torch.compile cannot compile: its documented
    # fallback); a user who changes nothing gets it, so its parity with torch's clipped, loss-scaled AdamW is
    # held to the same yardstick as kernel="compiled" above.
    ours, fused, loop = tiny_transformer(), tiny_transformer(), tiny_transformer()
    start = [p.detach().clone() for p in fused.parameters()]
    opt = engine(ours, clip_grad=0.05, loss_scale=1024.0, **ADAM)
    assert_compiled_unless_inductor_cannot_compile(opt.kernel_choice)
    for step in range(STEPS):
        opt.zero_grad()
        opt.scale_loss(loss_fn(ours, step)).backward()
        opt.step()
    for model, kw in ((fused, {"fused": True}), (loop, {"foreach": False})):
        ref = torch.optim.AdamW(decay_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95), **kw)
        _train_torch_clipped_scaled(model, ref, STEPS, 1024.0, 0.05)
    ours_drift = relative_drift(list(ours.parameters()), list(fused.parameters()), start)
    torch_drift = relative_drift(list(loop.parameters()), list(fused.parameters()), start)
    assert ours_drift < 1.5 * torch_drift and ours_drift < 3e-3


def test_reference_kernel_is_bitwise_equal_to_torch_single_tensor_adamw():
    # The reference kernel follows torch's for-loop AdamW op for op, with device-tensor hyperparameters.
    # (torch's own fused and for-loop AdamW drift apart by ~1.5e-3 of the motion over 50 steps here.)
    ours, theirs = tiny_transformer(), tiny_transformer()
    opt = engine(ours, kernel="reference", **ADAM)
    ref = torch.optim.AdamW(decay_groups(theirs, 0.1), lr=3e-3, betas=(0.9, 0.95), foreach=False)
    train(ours, opt, STEPS)
    train(theirs, ref, STEPS)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernel", ["fused", "compiled", "reference"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_torch_sgd(kernel, nesterov):
    ours, theirs = tiny_transformer(), tiny_transformer()
    opt = engine(ours, optimizer="sgd", lr=0.05, weight_decay=1e-3, sgd_momentum=0.9, sgd_nesterov=nesterov,
                 kernel=kernel)
    ref = torch.optim.SGD(decay_groups(theirs, 1e-3), lr=0.05, momentum=0.9, nesterov=nesterov)
    train(ours, opt, STEPS)
    train(theirs, ref, STEPS)
    assert relative_error(list(ours.parameters()), list(theirs.parameters())) < 1e-6


def test_sgd_without_momentum_keeps_no_state():
    model = tiny_transformer()
    opt = engine(model, optimizer="sgd", sgd_momentum=0.0)
    assert opt.buffers.state == {}
    train(model, opt, 3)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_params_match_an_fp32_master_reference_loop(precision):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    ours = tiny_transformer()  # built in fp32: the engine casts it and seeds fp32 main params from it
    opt = engine(ours, loss_scale=1.0, **{precision: True}, **ADAM)
    assert all(p.dtype == dtype for p in ours.parameters())

    # Hand-written fp32-master loop: half model for forward/backward, fp32 masters for the update.
    theirs = tiny_transformer()
    masters = [p.detach().clone() for p in theirs.parameters()]
    theirs.to(dtype)
    master_params = [torch.nn.Parameter(m) for m in masters]
    groups = decay_groups(theirs, 0.1)
    index = {id(p): i for i, p in enumerate(theirs.parameters())}
    master_groups = [{"params": [master_params[index[id(p)]] for p in g["params"]],
                      "weight_decay": g["weight_decay"]} for g in groups]
    ref = torch.optim.AdamW(master_groups, lr=3e-3, betas=(0.9, 0.95), fused=True)
    for step in range(20):
        opt.zero_grad()
        loss_fn(ours, step).backward()
        opt.step()

        theirs.zero_grad()
        loss_fn(theirs, step).backward()
        for p, m in zip(theirs.parameters(), master_params):
            m.grad = p.grad.float()
        ref.step()
        with torch.no_grad():
            for p, m in zip(theirs.parameters(), master_params):
                p.copy_(m)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    main = opt.buffers.main_shard[0]
    assert main.dtype == torch.float32
    for i, m in enumerate(master_params):
        place = opt.layout.params[i]
        assert torch.equal(main[place.start:place.end].view(place.shape), m.detach())


@pytest.mark.parametrize("make_scheduler", [
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=30),
], ids=["LambdaLR", "CosineAnnealingLR", "OneCycleLR"])
def test_torch_lr_schedulers_drive_the_engine(make_scheduler):
    ours, theirs = tiny_transformer(), tiny_transformer()
    opt = engine(ours, **ADAM)
    ref = torch.optim.AdamW(decay_groups(theirs, 0.1), lr=3e-3, betas=(0.9, 0.95), fused=True)
    ours_sched, theirs_sched = make_scheduler(opt), make_scheduler(ref)
    train(ours, opt, 25, scheduler=ours_sched)
    train(theirs, ref, 25, scheduler=theirs_sched)
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert opt.param_groups[0]["betas"] == ref.param_groups[0]["betas"]
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_params_and_grads_are_static_views():
    model = tiny_transformer()
    opt = engine(model, **ADAM)
    flat = opt.buffers.param_flat[0]
    grad_flat = opt.buffers.grad_flat[0]
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for p in model.parameters():
        assert lo <= p.data_ptr() < hi
    addresses = {name: t.data_ptr() for name, t in opt.buffers.addresses().items()}
    train(model, opt, 3)
    for p in model.parameters():
        assert grad_flat.data_ptr() <= p.grad.data_ptr() < grad_flat.data_ptr() + grad_flat.numel() * 4
    assert {name: t.data_ptr() for name, t in opt.buffers.addresses().items()} == addresses
    opt.zero_grad()
    assert grad_flat.abs().sum() == 0


def test_model_zero_grad_set_to_none_is_recovered():
    ours, theirs = tiny_transformer(), tiny_transformer()
    opt = engine(ours, **ADAM)
    ref = torch.optim.AdamW(decay_groups(theirs, 0.1), lr=3e-3, betas=(0.9, 0.95), fused=True)
    for step in range(5):
        ours.zero_grad(set_to_none=True)  # the user's habit: grads become None, backward allocates new ones
        loss_fn(ours, step).backward()
        opt.step()
        ref.zero_grad()
        loss_fn(theirs, step).backward()
        ref.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_state_dict_round_trip_loads_in_place():
    model = tiny_transformer()
    opt = engine(model, **ADAM)
    train(model, opt, 5)
    saved = opt.state_dict()
    train(model, opt, 5, start=5)
    expected = [p.detach().clone() for p in model.parameters()]

    fresh = tiny_transformer(seed=1)
    opt2 = engine(fresh, **ADAM)
    addresses = {name: t.data_ptr() for name, t in opt2.buffers.addresses().items()}
    opt2.load_state_dict(saved)
    assert {name: t.data_ptr() for name, t in opt2.buffers.addresses().items()} == addresses
    again = opt2.state_dict()
    for a, b in zip(again["main_params"], saved["main_params"]):
        assert torch.equal(a, b)
    for name in saved["state"]:
        for a, b in zip(again["state"][name], saved["state"][name]):
            assert torch.equal(a, b)
    assert torch.equal(again["step"], saved["step"])
    train(fresh, opt2, 5, start=5)
    for a, b in zip(fresh.parameters(), expected):
        assert torch.equal(a, b)


def test_load_state_dict_refuses_another_layout():
    a, b = tiny_transformer(), torch.nn.Linear(4, 4)
    saved = engine(a, **ADAM).state_dict()
    with pytest.raises(ValueError, match="different layout"):
        engine(b, **ADAM).load_state_dict(saved)


def test_bad_input_is_refused_with_a_clear_message():
    model = tiny_transformer()
    with pytest.raises(TypeError, match="OptimizerConfig"):
        gs.get_optimizer({"lr": 1.0}, model)
    with pytest.raises(TypeError, match="nn.Module"):
        gs.get_optimizer(gs.OptimizerConfig(), [1, 2])
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        gs.get_optimizer(gs.OptimizerConfig(), frozen)
    opt = engine(model, **ADAM)
    with pytest.raises(RuntimeError, match="lays params out once"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)
    with pytest.raises(TypeError, match="write a Python float"):
        opt.step()


def test_compiled_kernel_without_warm_up_is_refused_where_the_default_capture_would_capture(monkeypatch):
    # capture="auto" captures on CUDA, where the compiled kernel would compile inside the capture; the
    # config alone cannot tell (it refuses capture="graph" so). Here the device is made to look like CUDA.
    import graphstep.assembly as engine_module

    monkeypatch.setattr(engine_module, "backend_for",
                        lambda device, mode: ("eager", None) if mode == "eager" else ("cuda", None))
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="capture_warmup_steps >= 1"):
        gs.get_optimizer(gs.OptimizerConfig(kernel="compiled", capture_warmup_steps=0), model)
    opt = gs.get_optimizer(gs.OptimizerConfig(kernel="compiled", capture="eager", capture_warmup_steps=0), model)
    assert opt.kernel_choice.name == "compiled"
