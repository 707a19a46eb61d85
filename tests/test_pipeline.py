"""The gradient pipeline on device: clipping, loss scaling, skip on inf, zero counting, no host sync."""

import math

import pytest
import torch

import capture
from _engine import make_engine
from toy import decay_groups, loss_fn, relative_drift, relative_error, tiny_transformer

DTYPES = {"fp32": {}, "bf16": {"bf16": True}, "fp16": {"fp16": True}}


def snapshot(opt):
    """Every tensor a skipped step must leave bitwise unchanged."""
    tensors = {f"param_flat[{b}]": t for b, t in enumerate(opt.buffers.param_flat)}
    tensors.update({f"main_shard[{b}]": t for b, t in enumerate(opt.buffers.main_shard)})
    for name, state in opt.buffers.state.items():
        tensors.update({f"{name}[{b}]": t for b, t in enumerate(state)})
    tensors["step"] = opt.tensors.step
    return {name: t.clone() for name, t in tensors.items()}


@pytest.mark.parametrize("rule", ["adam", "sgd"])
def test_clipping_matches_clip_grad_norm(rule):
    ours, theirs = tiny_transformer(), tiny_transformer()
    start = [p.detach().clone() for p in theirs.parameters()]
    if rule == "adam":
        opt = make_engine(ours, lr=3e-3, weight_decay=0.1, adam_beta2=0.95, clip_grad=0.5)
        ref = torch.optim.AdamW(decay_groups(theirs, 0.1), lr=3e-3, betas=(0.9, 0.95), fused=True)
    else:
        opt = make_engine(ours, optimizer="sgd", lr=0.05, weight_decay=1e-3, clip_grad=0.5)
        ref = torch.optim.SGD(decay_groups(theirs, 1e-3), lr=0.05, momentum=0.9)
    clipped = 0
    for step in range(20):
        opt.zero_grad()
        loss_fn(ours, step).backward()
        result = opt.step()
        ref.zero_grad()
        loss_fn(theirs, step).backward()
        norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
        ref.step()
        assert math.isclose(result.grad_norm.item(), norm.item(), rel_tol=1e-6)
        clipped += norm.item() > 0.5
    assert clipped >= 10  # the threshold really clips
    if rule == "sgd":
        assert relative_error(list(ours.parameters()), list(theirs.parameters())) < 1e-6
    else:
        assert relative_drift(list(ours.parameters()), list(theirs.parameters()), start) < 1e-3


def test_clipping_with_fp16_loss_scaling_in_the_loop():
    # Both sides scale the loss by 1024 and unscale; the engine folds unscale and clip into the update.
    ours, theirs = tiny_transformer(), tiny_transformer()
    start = [p.detach().clone() for p in theirs.parameters()]
    opt = make_engine(ours, optimizer="sgd", lr=0.05, weight_decay=0.0, clip_grad=0.5, loss_scale=1024.0)
    ref = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    for step in range(20):
        opt.zero_grad()
        opt.scale_loss(loss_fn(ours, step)).backward()
        result = opt.step()
        ref.zero_grad()
        (loss_fn(theirs, step) * 1024.0).backward()
        for p in theirs.parameters():
            p.grad.div_(1024.0)
        norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
        ref.step()
        assert math.isclose(result.grad_norm.item(), norm.item(), rel_tol=1e-6)
    assert relative_error(list(ours.parameters()), list(theirs.parameters())) < 1e-6
    assert relative_drift(list(ours.parameters()), list(theirs.parameters()), start) < 1e-4


def test_fp16_dynamic_scaling_trains_and_reports_the_scale():
    model = tiny_transformer()
    opt = make_engine(model, fp16=True, initial_loss_scale=2.0**8, loss_scale_window=5, lr=1e-3)
    scales = []
    for step in range(12):
        opt.zero_grad()
        opt.scale_loss(loss_fn(model, step)).backward()
        result = opt.step()
        scales.append(result.loss_scale.item())
    assert scales[3] == 2.0**8 and scales[4] == 2.0**9 and scales[9] == 2.0**10  # grows after every 5 clean steps
    assert opt.tensors.step.item() == 12


@pytest.mark.parametrize("rule", ["adam", "sgd"])
@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_non_finite_grad_skips_the_step_bitwise(rule, precision, bad):
    model = tiny_transformer()
    opt = make_engine(model, optimizer=rule, clip_grad=1.0, lr=1e-3, **DTYPES[precision])
    for step in range(3):  # some real steps first, so the state is non-trivial
        opt.zero_grad()
        opt.scale_loss(loss_fn(model, step)).backward()
        opt.step()
    scale_before = opt.loss_scale.clone()
    names = [name for name, _ in model.named_parameters()]
    for victim in (0, len(names) // 2, len(names) - 1):  # any single param
        before = snapshot(opt)
        opt.zero_grad()
        opt.scale_loss(loss_fn(model, 3)).backward()
        param = dict(model.named_parameters())[names[victim]]
        param.main_grad.view(-1)[0] = bad
        result = opt.step()
        assert not result.update_successful.item()
        after = snapshot(opt)
        for name in before:
            assert torch.equal(before[name], after[name]), f"{name} changed on a skipped step ({names[victim]})"
    if precision == "fp16":
        assert opt.loss_scale.item() < scale_before.item()  # dynamic scaling backed off


def test_grad_norm_skip_threshold_skips_on_device():
    model = tiny_transformer()
    opt = make_engine(model, grad_norm_skip_threshold=1e-3)
    before = snapshot(opt)
    opt.zero_grad()
    loss_fn(model, 0).backward()
    result = opt.step()
    assert not result.update_successful.item() and result.grad_norm.item() > 1e-3
    assert all(torch.equal(before[k], v) for k, v in snapshot(opt).items())
    opt.grad_norm_skip_threshold = math.inf  # live: the next step sees it
    opt.zero_grad()
    loss_fn(model, 0).backward()
    assert opt.step().update_successful.item()


def test_clip_threshold_is_live():
    model = tiny_transformer()
    opt = make_engine(model, clip_grad=0.0)
    opt.zero_grad()
    loss_fn(model, 0).backward()
    opt.step()
    assert opt.tensors.clip_coef.item() == 1.0
    opt.clip_grad = 1e-3
    opt.zero_grad()
    loss_fn(model, 1).backward()
    result = opt.step()
    assert math.isclose(opt.tensors.clip_coef.item(), 1e-3 / (result.grad_norm.item() + 1e-6), rel_tol=1e-5)


def test_num_zeros_counts_zero_grads_and_ignores_padding():
    model = tiny_transformer()
    opt = make_engine(model, log_num_zeros_in_grad=True)
    opt.zero_grad()
    loss_fn(model, 0).backward()
    expected = sum((p.grad == 0).sum().item() for p in model.parameters())
    result = opt.step()
    assert result.num_zeros.item() == expected
    opt.zero_grad()
    assert opt.step().num_zeros.item() == sum(p.numel() for p in model.parameters())


def test_weight_decay_and_betas_schedules_reach_the_next_step():
    ours, theirs = tiny_transformer(), tiny_transformer()
    opt = make_engine(ours, lr=3e-3, weight_decay=0.1, clip_grad=0.0)
    ref = torch.optim.AdamW(decay_groups(theirs, 0.1), lr=3e-3, fused=True)
    for step in range(10):
        for o in (opt, ref):
            o.param_groups[0]["weight_decay"] = 0.1 * (step + 1)
            o.param_groups[0]["betas"] = (0.9 - 0.01 * step, 0.999)
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            loss_fn(model, step).backward()
            o.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernel", ["fused", "compiled", "reference"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_whole_step_runs_without_a_host_sync(kernel, precision):
    # capture.check runs the step once under capture's own detector of host syncs, data-dependent shapes
    # and device-to-host reads (the one the replay backend refuses them with), and lists what it found.
    model = tiny_transformer()
    opt = make_engine(model, kernel=kernel, clip_grad=0.5, grad_norm_skip_threshold=1e4, log_num_zeros_in_grad=True,
                 initial_loss_scale=2.0**8, **DTYPES[precision])
    for step in range(3):
        opt.zero_grad()
        opt.scale_loss(loss_fn(model, step)).backward()
        if step == 0:
            # The first step copies the hyperparameters in from a fresh host tensor (outside the captured
            # chain, only when they change): that is host-side preparation, not part of the step checked.
            opt.step()
        else:
            assert capture.check(opt.step) == []
    assert opt.tensors.step.item() == 3


def test_the_checker_itself_catches_a_sync():
    findings = capture.check(lambda: torch.ones(2).sum().item())
    assert findings and "_local_scalar_dense" in str(findings[0])


@pytest.mark.parametrize("config, passed", [({"clip_grad": 0.0}, False), ({"clip_grad": 1.0}, True),
                                             ({"fp16": True, "clip_grad": 0.0}, True),
                                             ({"loss_scale": 8.0, "clip_grad": 0.0}, True)])
def test_the_kernel_gets_the_grad_scale_only_when_it_can_differ_from_one(monkeypatch, config, passed):
    # torch's fused kernels write the divided grads back whenever given a grad scale: 4 B/param extra.
    calls = []
    kernel = torch._fused_adamw_

    def spy(*args, **kwargs):
        calls.append(kwargs.get("grad_scale"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    model = tiny_transformer()
    opt = make_engine(model, **config)
    opt.zero_grad()
    opt.scale_loss(loss_fn(model, 0)).backward()
    opt.step()
    assert calls and all((g is not None) == passed for g in calls)
