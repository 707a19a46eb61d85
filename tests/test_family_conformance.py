"""The same guarantees for every registered optimizer family (graphstep/families/), asked of the registry,
so a new family gets them by being registered: a captured step replays bitwise equal to
eager while every hyperparameter the family reads moves (no recapture where the kernel reads it live), a
non-finite grad leaves params, state and step bitwise unchanged, both checkpoint formats round-trip, with
each state's invariant (a second moment is never negative) refused on load, and CPU offload is bitwise
equal to no offload where the family declares it supported, refused naming the family where not."""

import math

import pytest
import torch

import graphstep as gs
from graphstep.families import FAMILIES, get_family, state_spec
from graphstep.kernels.muon import QKVSplit
from toy import WIDTH, loss_fn, tiny_transformer

INF_STEP = 5
STEPS = 8


def model(seed=0):
    net = tiny_transformer(seed)
    net[1].self_attn.in_proj_weight.qkv_split = QKVSplit(1, WIDTH, WIDTH, WIDTH)  # Muon's fused QKV layout
    return net


def config(name, **changes):
    # kernel="reference": every hyperparameter live, so a moving value never recaptures.
    return gs.OptimizerConfig(**{**dict(optimizer=name, lr=1e-2, clip_grad=0.5, kernel="reference",
                                        capture_warmup_steps=2), **changes})


def move_hyperparameters(opt, step: int) -> None:
    """Every field each group's family reads, moved a little, through the group keys the registry names."""
    wave = 1 + 0.1 * math.sin(step)
    for group in opt.param_groups:
        for field in get_family(group.get("optimizer", opt.config.optimizer)).fields:
            if field.index is None:
                group[field.key] = group[field.key] * wave
            else:
                values = list(group[field.key])
                values[field.index] = min(values[field.index] * wave, 0.999)
                group[field.key] = tuple(values)


def snapshot(opt, net):
    return ([t.clone() for t in opt.buffers.main_shard], {n: [t.clone() for t in ts] for n, ts in opt.buffers.state.items()},
            opt.tensors.step.clone(), [p.detach().clone() for p in net.parameters()])


def assert_equal(a, b):
    main_a, state_a, step_a, params_a = a
    main_b, state_b, step_b, params_b = b
    assert all(torch.equal(x, y) for x, y in zip(main_a, main_b))
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(x, y) for n in state_a for x, y in zip(state_a[n], state_b[n]))
    assert torch.equal(step_a, step_b)
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))


def train(name, mode, steps=STEPS):
    net = model()
    opt = gs.get_optimizer(config(name, capture=mode), net)
    flags, skipped = [], None
    for step in range(steps):
        move_hyperparameters(opt, step)
        opt.zero_grad()
        loss_fn(net, step).backward()
        if step == INF_STEP:
            before = snapshot(opt, net)
            net[1].linear1.weight.main_grad[0, 0] = float("nan")
        flags.append(bool(opt.step().update_successful))
        if step == INF_STEP:
            skipped = (before, snapshot(opt, net))
    return net, opt, flags, skipped


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runs(request):
    name = request.param
    return name, train(name, "eager"), train(name, "graph")


def test_the_config_family_updates_some_group(runs):
    name, _, (_, opt, _, _) = runs
    assert any(group.get("optimizer", name) == name for group in opt.param_groups)


def test_replay_equals_eager_bitwise_with_every_hyperparameter_moving(runs):
    name, (net_e, opt_e, flags_e, _), (net_g, opt_g, flags_g, _) = runs
    assert opt_g.captured and opt_g.recaptures == 0, name
    assert flags_e == flags_g == [step != INF_STEP for step in range(STEPS)]
    assert_equal(snapshot(opt_e, net_e), snapshot(opt_g, net_g))


def test_a_non_finite_grad_leaves_everything_bitwise_unchanged(runs):
    name, _, (_, opt, _, (before, after)) = runs
    assert_equal(before, after)
    assert any(t.abs().sum() > 0 for ts in after[1].values() for t in ts), name  # state that did move before


def continue_both(a, b, net_a, net_b, step):
    for opt, net in ((a, net_a), (b, net_b)):
        opt.zero_grad()
        loss_fn(net, step).backward()
        opt.step()
    assert_equal(snapshot(a, net_a), snapshot(b, net_b))


@pytest.mark.parametrize("fmt", ["state_dict", "sharded_state_dict"])
def test_checkpoint_round_trip_then_training_continues_bitwise(runs, fmt):
    name, _, (net, opt, _, _) = runs
    twin_net = model(seed=1)
    twin = gs.get_optimizer(config(name, capture="graph"), twin_net)
    getattr(twin, "load_" + fmt)(getattr(opt, fmt)())
    continue_both(opt, twin, net, twin_net, STEPS)


def negative_flat(saved: dict, state: str) -> dict:
    saved["state"][state][0] = -saved["state"][state][0].abs() - 1
    return saved


def negative_sharded(saved: dict, state: str) -> dict:
    key = next(k for k in saved if k.startswith(f"optimizer.state.{state}."))
    saved[key] = -saved[key].abs() - 1
    return saved


@pytest.mark.parametrize("fmt, negative", [("state_dict", negative_flat), ("sharded_state_dict", negative_sharded)])
def test_a_negative_state_is_refused_exactly_where_its_family_declares_it(runs, fmt, negative):
    """Both formats ask the registry (``StateSpec.nonnegative``), so each state is checked as declared."""
    name, _, (_, opt, _, _) = runs
    twin = gs.get_optimizer(config(name), model(seed=1))
    assert opt.buffers.state
    for state in opt.buffers.state:
        saved = negative(getattr(opt, fmt)(), state)
        if state_spec(state).nonnegative:
            with pytest.raises(ValueError, match="negative"):
                getattr(twin, "load_" + fmt)(saved)
        else:
            getattr(twin, "load_" + fmt)(saved)  # a momentum may be negative


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cpu_offload_is_bitwise_where_the_family_supports_it_and_refused_where_not(name):
    # The host update runs torch's fused CPU kernels: compared with no offload on the fused kernel too,
    # half of the shard on the host must change nothing (both sides are the CPU here).
    offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    if not get_family(name).offload:
        with pytest.raises(ValueError, match=f"optimizer='{name}'"):
            gs.get_optimizer(config(name, kernel="fused", capture="eager", **offload), model())
        return
    results = []
    for extra in ({}, offload):
        net = model()
        opt = gs.get_optimizer(config(name, kernel="fused", capture="eager", **extra), net)
        for step in range(4):
            opt.zero_grad()
            loss_fn(net, step).backward()
            opt.step()
        results.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert not torch.equal(results[0][0], model()[0].weight.detach())  # the params did move
