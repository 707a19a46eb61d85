"""Muon (and Lion) through the engine: routing, eager vs captured bitwise with every hyperparameter moving,
skip on inf, op count by shape, and parity with the per-matrix reference of test_muon.py."""

import math

import pytest
import torch
from capture.profile import OpCounter

import graphstep as gs
from graphstep.kernels.muon import QKVSplit
from test_muon import reference_muon_step
from toy import WIDTH, loss_fn, tiny_transformer

INF_STEPS = {17, 31}


def muon_model(seed=0):
    model = tiny_transformer(seed)
    # torch's in_proj_weight is [all Q; all K; all V]: Megatron's grouped layout with one group.
    model[1].self_attn.in_proj_weight.qkv_split = QKVSplit(1, WIDTH, WIDTH, WIDTH)
    return model


def config(**changes):
    base = dict(optimizer="muon", lr=0.01, weight_decay=0.05, clip_grad=0.5, kernel="reference",
                capture_warmup_steps=2)
    return gs.OptimizerConfig(**{**base, **changes})


def run(mode, steps=50, **changes):
    model = muon_model()
    opt = gs.get_optimizer(config(capture=mode, **changes), model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    names = [n for n, _ in model.named_parameters()]
    flags = []
    for step in range(steps):
        for group in opt.param_groups:  # weight decay, momentum and Lion's betas move every step
            group["weight_decay"] = 0.05 * (1 + 0.5 * math.sin(step))
            if group["optimizer"] == "muon":
                group["momentum"] = 0.9 + 0.05 * math.cos(step)
            if group["optimizer"] == "lion":
                group["betas"] = (0.9 + 0.05 * math.sin(step), 0.98 + 0.01 * math.cos(step))
        opt.zero_grad()
        loss_fn(model, step).backward()
        if step in INF_STEPS:
            victim = dict(model.named_parameters())[names[step % len(names)]]
            victim.main_grad.view(-1)[0] = float("inf")
        flags.append(bool(opt.step().update_successful))
        sched.step()
    return model, opt, flags


def assert_same_state(a, b):
    for x, y in zip(a.buffers.main_shard, b.buffers.main_shard):
        assert torch.equal(x, y)
    for name in a.buffers.state:
        for x, y in zip(a.buffers.state[name], b.buffers.state[name]):
            assert torch.equal(x, y)
    assert torch.equal(a.tensors.step, b.tensors.step)


# ---------------------------------------------------------------- routing

def test_routing_puts_hidden_matrices_in_muon_groups_and_the_rest_in_the_scalar_optimizer():
    model = muon_model()
    model[1].linear2.weight.use_muon = False
    opt = gs.get_optimizer(config(muon_scalar_optimizer="lion"), model)
    by_name = {name: group for group in opt.param_groups for name in group["param_names"]}
    muon = {n for n, g in by_name.items() if g["optimizer"] == "muon"}
    assert muon == {"1.self_attn.in_proj_weight", "1.self_attn.out_proj.weight", "1.linear1.weight"}
    for name, group in by_name.items():
        if name not in muon:
            assert group["optimizer"] == "lion" and group["betas"] == (0.95, 0.98)
        else:
            assert group["momentum"] == 0.95 and "betas" not in group
    assert by_name["1.linear1.bias"]["weight_decay"] == 0.0  # the standard overrides still apply


def test_an_override_routes_params_per_param_key_and_plain_adam_keeps_its_groups():
    model = muon_model()
    overrides = {gs.ParamKey(name="*linear1.weight"): {"optimizer": "adam", "wd_mult": 0.5}}
    opt = gs.get_optimizer(config(), model, config_overrides=overrides)
    by_name = {name: group for group in opt.param_groups for name in group["param_names"]}
    assert by_name["1.linear1.weight"]["optimizer"] == "adam"
    assert by_name["1.linear1.weight"]["weight_decay"] == 0.05 * 0.5
    assert by_name["1.linear2.weight"]["optimizer"] == "muon"
    plain = gs.get_optimizer(gs.OptimizerConfig(), tiny_transformer())
    assert all("optimizer" not in group for group in plain.param_groups)
    with pytest.raises(ValueError, match="optimizer='rmsprop' must be one of"):
        gs.get_optimizer(config(), muon_model(), config_overrides={gs.ParamKey(name="*"): {"optimizer": "rmsprop"}})


def test_lion_alone_replays_bitwise_with_its_betas_live():
    results = []
    for mode in ("eager", "graph"):
        model = tiny_transformer()
        opt = gs.get_optimizer(config(optimizer="lion", lr=1e-3, capture=mode), model)
        assert all(g["optimizer"] == "lion" and g["betas"] == (0.95, 0.98) and "momentum" not in g
                   for g in opt.param_groups)
        for step in range(8):
            for group in opt.param_groups:
                group["betas"] = (0.9 + 0.01 * step, 0.98)
            opt.zero_grad()
            loss_fn(model, step).backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert opt.captured and opt.recaptures == 0
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_vector_routed_to_muon_and_fp16_are_refused():
    with pytest.raises(ValueError, match="2-D matrices only"):
        gs.get_optimizer(config(), muon_model(), config_overrides={gs.ParamKey(name="*.bias"): {"optimizer": "muon"}})
    with pytest.raises(ValueError, match="fp16"):
        config(fp16=True)


def test_a_megatron_fused_qkv_without_its_split_is_refused_with_what_to_do():
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_qkv = torch.nn.Linear(8, 24, bias=False)

    with pytest.raises(ValueError, match="qkv_split"):
        gs.get_optimizer(config(), Attention())
    gs.get_optimizer(config(muon_split_qkv=False), Attention())


# ---------------------------------------------------------------- captured = eager, all live

@pytest.mark.parametrize("scalar", ["adam", "lion"])
def test_replay_is_bitwise_equal_to_eager_over_50_steps_with_moving_hyperparameters(scalar):
    eager_model, eager_opt, eager_flags = run("eager", muon_scalar_optimizer=scalar)
    graph_model, graph_opt, graph_flags = run("graph", muon_scalar_optimizer=scalar)
    assert graph_opt.captured and graph_opt.capture_backend == "replay"
    assert graph_opt.recaptures == 0
    assert eager_flags == graph_flags and [i for i, ok in enumerate(eager_flags) if not ok] == sorted(INF_STEPS)
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(a, b)
    assert_same_state(eager_opt, graph_opt)


def test_bf16_params_replay_bitwise_equal_to_eager():
    eager_model, eager_opt, _ = run("eager", steps=20, bf16=True)
    graph_model, graph_opt, _ = run("graph", steps=20, bf16=True)
    assert graph_opt.captured and graph_opt.recaptures == 0
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert_same_state(eager_opt, graph_opt)


def test_an_injected_inf_skips_bitwise():
    model = muon_model()
    opt = gs.get_optimizer(config(capture="graph", muon_scalar_optimizer="adam"), model)
    for step in range(6):
        opt.zero_grad()
        loss_fn(model, step).backward()
        if step == 5:
            before = ([m.clone() for m in opt.buffers.main_shard],
                      {n: [t.clone() for t in ts] for n, ts in opt.buffers.state.items()}, opt.tensors.step.clone(),
                      [p.detach().clone() for p in model.parameters()])
            model[1].linear1.weight.main_grad[0, 0] = float("nan")
        result = opt.step()
    assert opt.captured and not bool(result.update_successful)
    main, state, step, params = before
    assert set(state) == {"exp_avg", "exp_avg_sq", "momentum_buffer"}
    for x, y in zip(main, opt.buffers.main_shard):
        assert torch.equal(x, y)
    for name in state:
        for x, y in zip(state[name], opt.buffers.state[name]):
            assert torch.equal(x, y) and x.abs().sum() > 0
    assert torch.equal(step, opt.tensors.step) and step.item() == 5
    for x, y in zip(params, model.parameters()):
        assert torch.equal(x, y)


def test_one_cycle_lr_cycles_muon_momentum_live_and_state_dict_round_trips():
    model = muon_model()
    opt = gs.get_optimizer(config(capture="graph"), model)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=20, base_momentum=0.85,
                                                max_momentum=0.95)
    seen = set()
    for step in range(10):
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()
        sched.step()
        seen.add(opt.hyper.host_value("momentum", 1))
    assert opt.recaptures == 0 and len(seen) == 10
    saved = opt.state_dict()
    twin = gs.get_optimizer(config(capture="graph"), muon_model(seed=1))
    twin.load_state_dict(saved)
    for a, b in zip(twin.buffers.main_shard, opt.buffers.main_shard):
        assert torch.equal(a, b)
    assert [g["optimizer"] for g in twin.param_groups] == [g["optimizer"] for g in opt.param_groups]


# ---------------------------------------------------------------- batched by shape

def count_step_ops(num, rows, cols):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(cols, rows, bias=False) for _ in range(num)],
                                torch.nn.LayerNorm(4))
    opt = gs.get_optimizer(config(capture="eager"), model)
    assert sum(len(g["params"]) for g in opt.param_groups if g["optimizer"] == "muon") == num
    sum((p * torch.randn_like(p)).sum() for p in model.parameters()).backward()
    with OpCounter() as counter:
        opt.step()
    return counter.count


def test_step_op_count_depends_on_shapes_not_matrices():
    # 8 matrices of 128x256 and 32 of 64x128: the same number of params, each of whole 4,096-element rows
    # (so the folded norm's step-side work has the same shape in both).
    few, many = count_step_ops(8, 128, 256), count_step_ops(32, 64, 128)
    assert abs(few - many) <= 0.1 * few, (few, many)


# ---------------------------------------------------------------- parity with the per-matrix reference

@pytest.mark.parametrize("nesterov", [False, True])
def test_engine_muon_equals_the_reference_bitwise(nesterov):
    torch.manual_seed(3)
    shapes = [(32, 64), (64, 32), (48, 48), (32, 64), (48, 48), (32, 64)]
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*s)) for s in shapes])
    reference = [p.detach().clone() for p in model]
    momenta = [torch.zeros_like(p) for p in reference]
    opt = gs.get_optimizer(config(capture="graph", clip_grad=0.0, muon_fp32_matmul_prec="highest",
                                  muon_nesterov=nesterov), model, config_overrides={})
    gen = torch.Generator().manual_seed(4)
    for step in range(8):
        lr, wd, mu = 0.02 / (1 + step), 0.1 + 0.01 * step, 0.95 - 0.01 * step
        for group in opt.param_groups:
            group.update(lr=lr, weight_decay=wd, momentum=mu)
        grads = [torch.randn(s, generator=gen) for s in shapes]
        opt.zero_grad()
        sum((p * g).sum() for p, g in zip(model, grads)).backward()
        opt.step()
        for p, g, m in zip(reference, grads, momenta):
            reference_muon_step(p, g, m, lr=lr, wd=wd, mu=mu, nesterov=nesterov, decoupled=True, grad_scale=1.0,
                                precision="highest")
    assert opt.captured and opt.recaptures == 0
    for got, want in zip(model, reference):
        assert torch.equal(got, want)
