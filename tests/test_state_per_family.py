"""Each optimizer-state buffer spans only the groups whose family keeps it (graphstep/state/state_ranges.py).

A Muon + Adam model pays Muon's momentum over Muon's matrices and Adam's two moments over the other params,
not every state over every element; one family keeps its whole-shard layout; checkpoints written when
every state spanned the whole shard still load, and the reshardable format is as it was.
"""

import pytest
import torch
from _engine import make_engine
from toy import loss_fn, tiny_transformer

from graphstep.checkpoint.sharded import state_key
from graphstep.checkpoint.state_dict import StateDictError
from graphstep.run.debug import _first_in_domain

MIXES = {"muon+adam": dict(optimizer="muon"), "muon+lion": dict(optimizer="muon", muon_scalar_optimizer="lion")}
STATE_BYTES = 4  # fp32 state, per element and state name


def build(**config):
    model = tiny_transformer()
    return model, make_engine(model, **config)


def train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()


def declared_state_bytes(opt) -> int:
    """What each group's family declares, over that group's own elements of the shard (its segments:
    its params and the alignment padding between them, which its kernel runs over)."""
    families = opt.domains[0].ctx.families
    total = 0
    for segment in opt.layout.segments(opt.rank):
        family = families[segment.group]
        total += segment.numel * STATE_BYTES * len(family.state_names(opt.config))
    return total


def state_bytes(opt) -> int:
    device = opt.memory_stats()["device"]
    return sum(device.get(name, 0) for name in opt.buffers.state)


@pytest.mark.parametrize("mix", MIXES)
def test_mixed_families_pay_what_each_declares_over_its_own_elements(mix):
    _, opt = build(**MIXES[mix])
    families = {f.name for f in opt.domains[0].ctx.families}
    assert families == {"muon", MIXES[mix].get("muon_scalar_optimizer", "adam")}
    assert state_bytes(opt) == declared_state_bytes(opt)
    # Muon's momentum covers exactly its matrices (whole, unpadded here): 4 B per matrix element.
    matrices = sum(p.numel() for g in opt.param_groups if g.get("optimizer") == "muon" for p in g["params"])
    assert opt.memory_stats()["device"]["momentum_buffer"] == STATE_BYTES * matrices
    whole_shard = sum(b.shard_numel for b in opt.layout.buffers)
    assert state_bytes(opt) < whole_shard * STATE_BYTES * len(opt.buffers.state)


@pytest.mark.parametrize("config", [dict(optimizer="adam"), dict(optimizer="sgd", sgd_momentum=0.9),
                                    dict(optimizer="ademamix")], ids=["adam", "sgd", "ademamix"])
def test_one_family_keeps_every_state_over_the_whole_shard(config):
    _, opt = build(**config)
    for name, tensors in opt.buffers.state.items():
        assert [t.numel() for t in tensors] == [b.shard_numel for b in opt.layout.buffers], name
    assert state_bytes(opt) == declared_state_bytes(opt) + sum(  # plus the buckets' tail padding, as before
        (b.shard_numel - sum(s.numel for s in opt.layout.segments(0) if s.buffer == b.index))
        * STATE_BYTES * len(opt.buffers.state) for b in opt.layout.buffers)


def whole_shard_format(opt, saved: dict) -> dict:
    """``saved`` as written when every state spanned the whole shard: each kept range at its shard
    coordinates, zeros elsewhere (what another family's elements held, never touched)."""
    old = dict(saved, state={})
    for name, tensors in saved["state"].items():
        ranges = opt.buffers.state_ranges[name]
        full = []
        for b, compact in enumerate(tensors):
            if ranges.whole(b):
                full.append(compact.clone())
                continue
            out = torch.zeros(opt.layout.buffers[b].shard_numel, dtype=compact.dtype)
            for start, end, offset in ranges.runs[b]:
                out[start:end] = compact[offset:offset + end - start]
            full.append(out)
        old["state"][name] = full
    return old


def snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], {
        name: [t.clone() for t in tensors] for name, tensors in opt.buffers.state.items()}


def assert_same(a, b):
    params_a, state_a = a
    params_b, state_b = b
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(x, y) for name in state_a for x, y in zip(state_a[name], state_b[name]))


def continue_from(saved_params, load, config):
    model, opt = build(**config)
    with torch.no_grad():
        for p, value in zip(model.parameters(), saved_params):
            p.copy_(value)
    load(opt)
    train(model, opt, 2, start=2)
    return snapshot(model, opt)


@pytest.mark.parametrize("mix", MIXES)
def test_a_whole_shard_flat_checkpoint_loads_and_training_continues_bitwise(mix):
    model, opt = build(**MIXES[mix])
    train(model, opt, 2)
    saved, params = opt.state_dict(), [p.detach().clone() for p in model.parameters()]
    old = whole_shard_format(opt, saved)
    assert any(o.numel() > s.numel() for name in saved["state"] for o, s in zip(old["state"][name],
                                                                                  saved["state"][name]))
    train(model, opt, 2, start=2)
    expected = snapshot(model, opt)
    assert_same(continue_from(params, lambda o: o.load_state_dict(old), MIXES[mix]), expected)
    assert_same(continue_from(params, lambda o: o.load_state_dict(saved), MIXES[mix]), expected)


def test_a_flat_state_of_neither_shape_is_refused_naming_the_key():
    model, opt = build(optimizer="muon")
    saved = opt.state_dict()
    saved["state"]["momentum_buffer"] = [t[:-1] for t in saved["state"]["momentum_buffer"]]
    with pytest.raises(StateDictError, match="momentum_buffer"):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("mix", MIXES)
def test_sharded_checkpoint_round_trip_keeps_every_state_of_every_param(mix):
    model, opt = build(**MIXES[mix])
    train(model, opt, 2)
    saved = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.sharded_state_dict().items()}
    params = [p.detach().clone() for p in model.parameters()]
    # The format is as it was: every state for every param, another family's state as zeros.
    for name in opt.buffers.state:
        for place in opt.layout.params:
            assert saved[state_key(name, place.name)].numel() == place.numel
    muon_matrix = next(p.name for p in opt.layout.params
                       if opt.domains[0].ctx.families[p.group].name == "muon")
    assert not saved[state_key("momentum_buffer", muon_matrix)].eq(0).all()
    assert saved[state_key("exp_avg", muon_matrix)].eq(0).all()
    train(model, opt, 2, start=2)
    expected = snapshot(model, opt)
    assert_same(continue_from(params, lambda o: o.load_sharded_state_dict(saved), MIXES[mix]), expected)


def test_the_nan_search_looks_only_at_the_states_a_param_keeps():
    _, opt = build(optimizer="muon")
    domain = opt.domains[0]
    assert _first_in_domain(domain.buffers, domain.layout, domain.rank, "update", False) is None
    opt.buffers.state["momentum_buffer"][0][0] = float("nan")
    origin = _first_in_domain(domain.buffers, domain.layout, domain.rank, "update", False)
    assert origin is not None and origin.tensor == "momentum_buffer"
    assert domain.ctx.families[next(p.group for p in domain.layout.params if p.name == origin.param)].name == "muon"
