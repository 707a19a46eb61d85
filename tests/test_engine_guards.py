"""No silent failure: each case here failed silently or with an internal error
before, and must now either work exactly or be refused with a message that names what to fix."""

import warnings

import pytest
import torch

from _engine import make_engine
from toy import loss_fn, tiny_transformer


def _linear(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 8).to(dtype)


def _backward(model, scale=1.0):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3)).to(next(model.parameters()).dtype)
    (model(x).square().sum() * scale).backward()


def test_grads_set_to_none_after_backward_are_not_applied():
    # loss.backward(); model.zero_grad(set_to_none=True); opt.step() equals a step on zero grads.
    discarded, zero = _linear(), _linear()
    opts = [make_engine(m, lr=0.1, weight_decay=0.1, clip_grad=0.0) for m in (discarded, zero)]
    _backward(discarded)
    discarded.zero_grad(set_to_none=True)
    _backward(zero)
    opts[1].zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for opt in opts:
            opt.step()
    for a, b in zip(discarded.parameters(), zero.parameters()):
        assert torch.equal(a, b)
    _backward(discarded)  # the next backward starts from zero, not from the discarded grads
    _backward(zero)
    for a, b in zip(discarded.parameters(), zero.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("capture", ["eager", "graph"])
def test_a_finite_grad_whose_square_overflows_fp32_is_not_skipped(capture):
    model = _linear()
    opt = make_engine(model, lr=0.1, clip_grad=1.0, capture=capture, capture_warmup_steps=1)
    for _ in range(3):
        opt.zero_grad()
        _backward(model)
        model.weight.grad[0, 0] = 3e19  # finite; its square is not
        result = opt.step()
    assert bool(result.update_successful)
    assert torch.isfinite(result.grad_norm) and float(result.grad_norm) == pytest.approx(3e19, rel=1e-6)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_skip_by_norm_threshold_leaves_the_dynamic_loss_scale_as_a_clean_step_would():
    # Megatron-Core's scaler reacts to inf/NaN only; a finite norm over the threshold skips the update.
    skipped, clean = (tiny_transformer(dtype=torch.float16) for _ in range(2))
    config = dict(fp16=True, lr=1e-3, initial_loss_scale=2.0 ** 10, loss_scale_window=2, hysteresis=1)
    opt_skipped = make_engine(skipped, grad_norm_skip_threshold=1e-9, **config)
    opt_clean = make_engine(clean, **config)
    for step in range(5):
        for model, opt in ((skipped, opt_skipped), (clean, opt_clean)):
            opt.zero_grad()
            opt.scale_loss(loss_fn(model, step)).backward()
            result = opt.step()
        assert not bool(opt_skipped.result.update_successful) and bool(result.update_successful)
        assert torch.equal(opt_skipped.loss_scale, opt_clean.loss_scale)
    assert float(opt_clean.loss_scale) == 2.0 ** 12  # it grew twice in 5 clean steps (window 2)


def test_step_before_any_backward_warns_once():
    model = _linear()
    opt = make_engine(model, lr=0.1, weight_decay=0.1)
    with pytest.warns(RuntimeWarning, match="before any backward"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once only
        _backward(model)
        opt.step()


def test_no_warning_when_backward_ran_first():
    model = _linear()
    opt = make_engine(model, lr=0.1)
    _backward(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


@pytest.mark.parametrize("make", [
    lambda: (_linear(dtype=torch.float64), {}),
    lambda: (torch.nn.Sequential(_linear(), _linear(dtype=torch.float64)), {}),
    lambda: (_linear(), {"params_dtype": torch.float64}),
], ids=["fp64", "mixed fp32/fp64", "params_dtype fp64"])
def test_float64_params_are_refused_at_build_with_a_clear_message(make):
    model, config = make()
    with pytest.raises(ValueError, match="float64.*model.float()"):
        make_engine(model, lr=0.1, **config)


def test_complex_params_are_refused_naming_the_param():
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="param 'w' is complex"):
        make_engine(model, lr=0.1, bf16=True)


def test_a_non_leaf_param_is_refused_naming_it():
    model = _linear()
    model._parameters["weight"] = model.weight * 2  # bypasses nn.Module's Parameter check
    with pytest.raises(ValueError, match="param 'weight' is not a leaf"):
        make_engine(model, lr=0.1)


@pytest.mark.parametrize("field,value", [("lr", float("nan")), ("lr", float("inf")),
                                         ("weight_decay", float("nan")), ("lr", "0.1")])
def test_non_finite_or_non_numeric_group_hyperparameters_are_refused_before_the_step(field, value):
    model = _linear()
    opt = make_engine(model, lr=0.1)
    _backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0][field] = value
    with pytest.raises((ValueError, TypeError), match=field):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


@pytest.mark.parametrize("field,value", [("clip_grad", float("nan")), ("clip_grad", -1.0),
                                         ("grad_norm_skip_threshold", float("nan"))])
def test_non_finite_step_thresholds_are_refused(field, value):
    model = _linear()
    opt = make_engine(model, lr=0.1, clip_grad=1.0)
    _backward(model)
    setattr(opt, field, value)
    with pytest.raises(ValueError, match="clip_grad|grad_norm_skip_threshold"):
        opt.step()


def _snapshot(opt):
    sd = opt.state_dict()
    return [t.clone() for t in sd["main_params"]], {k: [t.clone() for t in v] for k, v in sd["state"].items()}, \
        sd["step"].clone()


@pytest.mark.parametrize("seed,initial_scale", [(0, 2.0 ** 120), (1, 2.0 ** 12), (2, 2.0 ** 12)])
def test_non_finite_sweep_with_all_zero_stretches_never_corrupts_and_keeps_the_scale_bounded(seed, initial_scale):
    """Random clean, all-zero, inf and NaN steps through eager and captured (capturing, then replayed)
    steps with a dynamic loss scale that starts near the top: a skipped step changes nothing, captured
    equals eager bitwise, and the scale stays finite within [min_loss_scale, 2**127]."""
    import random

    rng = random.Random(seed)
    kinds = [rng.choice(["clean", "zero", "zero", "zero", "inf", "nan"]) for _ in range(40)]
    config = dict(fp16=True, lr=1e-2, weight_decay=0.1, clip_grad=1.0, initial_loss_scale=initial_scale,
                  min_loss_scale=1.0, loss_scale_window=2, hysteresis=1, capture_warmup_steps=2)
    models = [tiny_transformer(dtype=torch.float16) for _ in range(2)]
    opts = [make_engine(models[0], capture="eager", **config), make_engine(models[1], capture="graph", **config)]
    applied_clean = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a first step on all-zero grads warns once
        for step, kind in enumerate(kinds):
            befores = []
            for model, opt in zip(models, opts):
                opt.zero_grad()
                if kind != "zero":
                    loss = loss_fn(model, step) * {"clean": 1.0, "inf": float("inf"), "nan": float("nan")}[kind]
                    opt.scale_loss(loss).backward()
                befores.append(_snapshot(opt))
                result = opt.step()
                scale = float(opt.loss_scale)
                assert 1.0 <= scale <= 2.0 ** 127, (step, kind, scale)
                if not bool(result.update_successful):
                    main, state, count = _snapshot(opt)
                    assert all(torch.equal(a, b) for a, b in zip(main, befores[-1][0])), (step, kind)
                    assert all(torch.equal(a, b) for name in state for a, b in zip(state[name], befores[-1][1][name]))
                    assert torch.equal(count, befores[-1][2])
                else:
                    assert kind in ("clean", "zero"), (step, kind)
                    applied_clean += kind == "clean"
            for a, b in zip(models[0].parameters(), models[1].parameters()):
                assert torch.equal(a, b), (step, kind)
            assert torch.equal(opts[0].loss_scale, opts[1].loss_scale)
    assert opts[1].captured and opts[1].recaptures == 0
    if initial_scale < 2.0 ** 16:
        assert applied_clean > 0  # real updates were applied between the skips, not only zero steps


def test_a_schedule_switching_on_sgd_momentum_without_buffers_is_refused_with_what_to_do():
    model = _linear()
    opt = make_engine(model, optimizer="sgd", lr=0.1, sgd_momentum=0.0)
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)  # cycles momentum by default
    _backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="sgd_momentum > 0.*cycle_momentum=False"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_a_per_group_nesterov_change_is_refused_not_ignored():
    model = _linear()
    opt = make_engine(model, optimizer="sgd", lr=0.1, sgd_momentum=0.9)
    opt.param_groups[0]["nesterov"] = True
    _backward(model)
    with pytest.raises(ValueError, match="nesterov=True: fixed at build"):
        opt.step()


@pytest.mark.parametrize("config", [dict(), dict(clip_grad=0.05), dict(bf16=True), dict(fp16=True,
                                                                                        initial_loss_scale=1.0)],
                         ids=["fp32", "clipped", "bf16", "fp16"])
def test_grads_computed_before_the_optimizer_was_built_are_stepped_on_as_torch_does(config):
    # torch's optimizers step on the .grad a backward left before they were built; graphstep takes those
    # values into its grad buffers at build instead of dropping them.
    model, reference = _linear(), _linear()
    for m in (model, reference):
        if config.get("bf16") or config.get("fp16"):  # the half dtype graphstep trains in, from the start
            m.to(torch.bfloat16 if config.get("bf16") else torch.float16)
        _backward(m)
    grads = [p.grad.clone() for p in model.parameters()]
    opt = make_engine(model, lr=0.1, weight_decay=0.0, **{"clip_grad": 0.0, **config})
    kept = [torch.equal(p.main_grad, g.to(p.main_grad.dtype)) for p, g in zip(model.parameters(), grads)]
    assert kept == [True, True]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "step() ran before any backward"
        opt.step()
    main = [p.detach().float().requires_grad_() for p in reference.parameters()]
    for p, m in zip(reference.parameters(), main):
        m.grad = p.grad.float()
    torch_opt = torch.optim.AdamW(main, lr=0.1, weight_decay=0.0)
    if config.get("clip_grad"):
        torch.nn.utils.clip_grad_norm_(main, config["clip_grad"])
    torch_opt.step()
    for p, m in zip(model.parameters(), main):
        torch.testing.assert_close(p.float(), m.to(p.dtype).float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replace", ["load_state_dict(assign=True)", "attribute"])
def test_a_param_replaced_by_a_new_object_after_the_build_is_refused_by_name(replace):
    # The model would compute with the new object while the optimizer steps the old one: training would
    # stop without a word, so the next step refuses, naming the param.
    model = _linear()
    opt = make_engine(model, lr=0.1)
    if replace == "attribute":
        model.bias = torch.nn.Parameter(torch.zeros(8))
    else:
        model.load_state_dict({k: v + 1 for k, v in model.state_dict().items()}, assign=True)
    _backward(model)
    with pytest.raises(RuntimeError, match="'bias'.*replaced by new Parameter objects.*assign=False"):
        opt.step()


def test_loading_in_place_and_tying_to_a_held_param_are_let_through():
    model = torch.nn.Sequential(_linear(), _linear(seed=1))
    opt = make_engine(model, lr=0.1)
    model.load_state_dict({k: v + 1 for k, v in model.state_dict().items()})  # copies into the held params
    model[1].weight = model[0].weight  # tied to a param the optimizer holds: nothing goes untrained
    before = model[0].weight.detach().clone()
    _backward(model)
    opt.step()
    assert not torch.equal(before, model[0].weight)


def test_a_dropped_optimizer_leaves_no_parameter_registration_hook_behind():
    import gc
    from torch.nn.modules import module as torch_module
    gc.collect()  # earlier tests' optimizers, dropped but not yet collected, would be counted now and not later
    before = len(torch_module._global_parameter_registration_hooks)
    model = _linear()
    opt = make_engine(model, lr=0.1)
    assert len(torch_module._global_parameter_registration_hooks) == before + 1
    del opt
    gc.collect()
    assert len(torch_module._global_parameter_registration_hooks) == before


def test_a_param_frozen_after_the_build_is_refused_by_name():
    # graphstep steps every param it holds: a frozen one would go on moving under weight decay and momentum,
    # where torch's optimizers leave a param without a grad alone.
    model = torch.nn.Sequential(_linear(), _linear(seed=1))
    opt = make_engine(model, lr=0.1, weight_decay=0.1)
    _backward(model)
    opt.step()
    opt.zero_grad()
    model[0].requires_grad_(False)
    _backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"'0\.weight', '0\.bias' do not require grad.*build a new optimizer"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # refused before anything moved


def test_a_param_unfrozen_after_the_build_is_refused_by_name():
    # A param frozen at the build has no place in the buffers: unfrozen, it would never be stepped.
    model = torch.nn.Sequential(_linear(), _linear(seed=1))
    model[0].weight.requires_grad_(False)
    opt = make_engine(model, lr=0.1)
    model[0].weight.requires_grad_(True)
    _backward(model)
    with pytest.raises(RuntimeError, match=r"'0\.weight' require grad now but were frozen when the optimizer"):
        opt.step()


def test_requires_grad_toggled_back_before_the_step_is_let_through():
    # Freezing for an evaluation (or a GAN's other phase) and unfreezing before the step changes nothing.
    torch.manual_seed(0)
    models = [torch.nn.Sequential(_linear(), _linear(seed=1)) for _ in range(2)]
    for m in models:
        m[1].bias.requires_grad_(False)  # frozen at the build and through the run: simply not trained
    opts = [make_engine(m, lr=0.1) for m in models]
    models[0].requires_grad_(False)
    models[0].requires_grad_(True)
    models[0][1].bias.requires_grad_(False)
    for m, opt in zip(models, opts):
        _backward(m)
        opt.step()
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b)


def test_a_model_cast_after_the_build_is_refused_by_name_and_left_as_the_user_cast_it():
    # Taking the cast params back into the fp32 buffers would quietly cast the model back to fp32.
    model = torch.nn.Sequential(_linear(), _linear(seed=1))
    opt = make_engine(model, lr=0.1)
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"param '0\.weight' was cast to torch.bfloat16.*keeps it in "
                                         r"torch.float32.*before building the optimizer"):
        opt.step()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_loaded_into_a_half_model_after_the_build_are_trained_on(dtype):
    # The main params are a copy of their own: the step would publish them over the loaded weights. The
    # oracle is the same model loaded before the optimizer was built (bitwise here: no init value rounds to
    # 0.5, so every element counts as written; one that rounded to its loaded value would keep its fp32 bits).
    precision = {"bf16": True} if dtype == torch.bfloat16 else {"fp16": True}
    loaded = {k: torch.full_like(v, 0.5) for k, v in _linear(dtype=dtype).state_dict().items()}
    models = [_linear(seed=1, dtype=dtype), _linear(seed=1, dtype=dtype)]
    models[1].load_state_dict(loaded)
    opts = [make_engine(m, lr=1e-3, **precision) for m in models]
    models[0].load_state_dict(loaded)  # after the build
    for m, opt in zip(models, opts):
        _backward(m, scale=opt.loss_scale.item())
        opt.step()
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b)
    assert torch.equal(opts[0].buffers.main_shard[0], opts[1].buffers.main_shard[0])


def test_an_in_place_write_into_a_bf16_param_reaches_the_main_params_and_nothing_else_changes():
    model = torch.nn.Sequential(_linear(dtype=torch.bfloat16), _linear(seed=1, dtype=torch.bfloat16))
    opt = make_engine(model, lr=0.1, bf16=True, weight_decay=0.0)
    for _ in range(2):
        _backward(model)
        opt.step()
        opt.zero_grad()
    main_before = opt.buffers.main_shard[0].clone()
    with torch.no_grad():
        model[0].weight.clamp_(-0.01, 0.01)  # WGAN-style: seen by the param's version counter
    model[1].weight.data.mul_(0.5)  # through .data: no counter sees it, reload_model_params takes it
    opt.reload_model_params()
    clamped, halved = model[0].weight.detach().clone(), model[1].weight.detach().clone()
    for group in opt.param_groups:
        group["lr"] = 0.0  # a step that moves nothing: it publishes the main params as they are
    _backward(model)
    opt.step()
    assert torch.equal(model[0].weight, clamped) and torch.equal(model[1].weight, halved)
    bias = next(i for i, place in enumerate(opt.layout.params) if place.name == "0.bias")
    (owned,) = [o for o in opt.layout.owned_ranges(0) if o.param == bias]
    span = slice(owned.shard_start, owned.shard_start + owned.param_end - owned.param_start)
    assert torch.equal(opt.buffers.main_shard[0][span], main_before[span])  # untouched: every fp32 bit kept


@pytest.mark.parametrize("edit", ["remove", "append", "replace", "new group"])
def test_an_edit_of_the_param_groups_params_is_refused(edit):
    # torch would stop stepping a removed param and start stepping an appended one; the layout cannot.
    model = torch.nn.Sequential(_linear(), _linear(seed=1))
    opt = make_engine(model, lr=0.1, weight_decay=0.1)
    params = opt.param_groups[0]["params"]
    if edit == "remove":
        params.pop()
    elif edit == "append":
        params.append(torch.nn.Parameter(torch.ones(3)))
    elif edit == "replace":
        opt.param_groups[0]["params"] = list(params)
    else:
        opt.param_groups.append({**opt.param_groups[0], "params": [torch.nn.Parameter(torch.ones(3))]})
    _backward(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"'params' list was edited|the optimizer was built with \d:"):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("key, value", [("maximize", True), ("amsgrad", True), ("dampening", 0.5)])
def test_torch_only_options_set_in_a_param_group_are_refused_by_name(key, value):
    model = _linear()
    opt = make_engine(model, lr=0.1, **({"optimizer": "sgd", "sgd_momentum": 0.9} if key == "dampening" else {}))
    opt.param_groups[0][key] = value
    _backward(model)
    with pytest.raises(ValueError, match=f"param group 0: {key}={value} is an option of torch's optimizers"):
        opt.step()
    opt.param_groups[0][key] = False if key != "dampening" else 0  # off again: steps
    opt.step()


@pytest.mark.parametrize("reset", ["clear", "del", "pop", "replace"])
def test_resetting_the_state_through_opt_state_is_refused(reset):
    # torch's optimizers start a param's moments over when its entry goes; graphstep's are in flat buffers.
    model = _linear()
    opt = make_engine(model, lr=0.1)
    _backward(model)
    opt.step()
    weight = model.weight
    with pytest.raises(TypeError, match="keeps the optimizer state in flat buffers.*build a new optimizer"):
        if reset == "clear":
            opt.state.clear()
        elif reset == "del":
            del opt.state[weight]
        elif reset == "pop":
            opt.state.pop(weight)
        else:
            opt.state = {}
            opt.step()
