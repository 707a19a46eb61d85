"""load_state_dict is all or nothing: a refused checkpoint names the key and
changes nothing; a valid one round-trips exactly. Malformed state dicts are mutations of a real one."""

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import graphstep as gs
from toy import loss_fn, tiny_transformer

CONFIGS = {
    # fp16 params: separate fp32 main params and a dynamic loss scaler.
    "adam_fp16": dict(optimizer="adam", lr=1e-2, weight_decay=0.1, fp16=True, initial_loss_scale=2.0 ** 8),
    # fp32 SGD with momentum on one rank: the main params are the params themselves.
    "sgd_fp32": dict(optimizer="sgd", lr=1e-2, sgd_momentum=0.9, weight_decay=0.1),
}


def small_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))


def build(name, seed):
    model = small_model(seed)
    opt = gs.get_optimizer(gs.OptimizerConfig(**CONFIGS[name]), model)
    return model, opt


def train(model, opt, steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        dtype = next(model.parameters()).dtype
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()


def snapshot(opt):
    """Every byte a load may write: params, main params, state, step, scaler, groups, thresholds."""
    return {
        "params": [t.clone() for t in opt.buffers.param_flat],
        "main": [t.clone() for t in opt.buffers.main_shard],
        "state": {k: [t.clone() for t in v] for k, v in opt.buffers.state.items()},
        "step": opt.tensors.step.clone(),
        "scaler": None if opt.scaler is None else opt.scaler.state_dict(),
        "groups": [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups],
        "clip": (opt.clip_grad, opt.grad_norm_skip_threshold),
    }


def same(a, b) -> bool:
    """Exact equality, tensors bitwise (dtype and shape included), sequences regardless of list/tuple."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return isinstance(a, bool) == isinstance(b, bool) and a == b


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def setup(request):
    """(name, saved state dict of a trained optimizer, a second optimizer whose state differs, its own sd)."""
    model_a, opt_a = build(request.param, seed=0)
    train(model_a, opt_a, 3)
    model_b, opt_b = build(request.param, seed=1)
    train(model_b, opt_b, 1)
    return request.param, opt_a.state_dict(), opt_b, opt_b.state_dict()


def assert_refused_unchanged(opt, bad, match):
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    assert same(snapshot(opt), before), "a refused load changed the optimizer"


# ---- item 3: a failed load changes nothing ------------------------------------------------------------
@pytest.mark.parametrize("mutate, key", [
    (lambda sd: sd["state"][sorted(sd["state"])[-1]].__setitem__(0, torch.zeros(3)), "state"),
    (lambda sd: sd.pop("clip_grad"), "clip_grad"),
    (lambda sd: sd.__setitem__("step", torch.tensor(-2.0)), "step"),
    (lambda sd: sd.__setitem__("step", torch.tensor(1.5)), "step"),
    (lambda sd: sd.__setitem__("step", torch.tensor([3.0])), "step"),
    (lambda sd: sd["param_groups"][-1].__setitem__("lr", "fast"), "lr"),
])
def test_failed_load_changes_nothing(setup, mutate, key):
    _, saved, opt, _ = setup
    bad = copy.deepcopy(saved)
    mutate(bad)
    assert_refused_unchanged(opt, bad, key)


def test_incomplete_scaler_state_changes_nothing():
    model_a, opt_a = build("adam_fp16", 0)
    train(model_a, opt_a, 2)
    _, opt = build("adam_fp16", 1)
    for mutate in (lambda s: s.pop("hysteresis_tracker"), lambda s: s.__setitem__("scale", "big"),
                   lambda s: s.__setitem__("scale", torch.tensor(float("inf")))):
        bad = copy.deepcopy(opt_a.state_dict())
        mutate(bad["scaler"])
        assert_refused_unchanged(opt, bad, "scaler")
    bad = opt_a.state_dict()
    bad["scaler"] = None
    assert_refused_unchanged(opt, bad, "scaler")


# ---- item 4: garbage refused, naming the key ---------------------------------------------------------
def test_garbage_is_refused_naming_the_key(setup):
    _, saved, opt, _ = setup
    cases = []
    bad = copy.deepcopy(saved)
    bad["main_params"][0] = bad["main_params"][0].to(torch.int64)  # would be silently cast
    cases.append((bad, "main_params"))
    bad = copy.deepcopy(saved)
    name = sorted(bad["state"])[0]
    bad["state"][name][0][3] = float("nan")
    cases.append((bad, name))
    bad = copy.deepcopy(saved)
    bad["main_params"][0][1] = float("inf")
    cases.append((bad, "main_params"))
    bad = copy.deepcopy(saved)
    bad["param_groups"][0]["weight_decay"] = None
    cases.append((bad, "weight_decay"))
    bad = copy.deepcopy(saved)
    bad["param_groups"][0]["lr"] = float("nan")
    cases.append((bad, "lr"))
    cases.append((list(saved.items()), "state_dict"))
    bad = copy.deepcopy(saved)
    bad["state"] = list(bad["state"].values())
    cases.append((bad, "state"))
    bad = copy.deepcopy(saved)
    bad["clip_grad"] = float("nan")
    cases.append((bad, "clip_grad"))
    for bad, key in cases:
        assert_refused_unchanged(opt, bad, key)


def test_valid_checkpoint_still_round_trips_exactly(setup):
    _, saved, opt, own = setup
    opt.load_state_dict(saved)
    assert same(opt.state_dict(), saved)
    opt.load_state_dict(own)
    assert same(opt.state_dict(), own)


# ---- the property: refused naming the key with nothing changed, or an exact round trip -----------------
def leaf_paths(value, path=()):
    """Every path into the nested state dict (dict keys and sequence indices), leaves and containers."""
    paths = [path] if path else []
    if isinstance(value, dict):
        for k, v in value.items():
            paths += leaf_paths(v, path + (k,))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            paths += leaf_paths(v, path + (i,))
    return paths


def replaced(value, path, fn):
    """A copy of ``value`` with the item at ``path`` replaced by fn(item) (fn returns DROP to delete)."""
    if not path:
        return fn(value)
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        out = dict(value)
        new = replaced(value[head], rest, fn)
        if new is DROP:
            del out[head]
        else:
            out[head] = new
        return out
    items = list(value)
    new = replaced(items[head], rest, fn)
    if new is DROP:
        del items[head]
    else:
        items[head] = new
    return type(value)(items) if isinstance(value, tuple) else items


DROP = object()
GARBAGE = [None, "x", [], {}, 1.5, -1, 0, float("nan"), float("inf"), True, torch.tensor(float("nan")),
           torch.zeros(3, dtype=torch.int64), torch.tensor(2.0), [1.0, 2.0]]
ELEMENTS = [0.0, 1.0, -1.0, 3.0, 0.5, 1e30, float("nan"), float("inf"), float("-inf")]


def mutation(data, sd):
    path = data.draw(st.sampled_from(leaf_paths(sd)), label="path")
    kind = data.draw(st.sampled_from(["drop", "replace", "retype", "reshape", "element"]), label="kind")
    if kind == "drop":
        return path, lambda v: DROP
    if kind == "replace":
        garbage = data.draw(st.sampled_from(range(len(GARBAGE))), label="garbage")
        return path, lambda v: copy.deepcopy(GARBAGE[garbage])
    if kind == "retype":
        dtype = data.draw(st.sampled_from([torch.int64, torch.float64, torch.float16, torch.bfloat16,
                                           torch.float32]), label="dtype")
        return path, lambda v: v.to(dtype) if isinstance(v, torch.Tensor) else str(v)
    if kind == "reshape":
        return path, lambda v: (v.unsqueeze(0) if v.numel() < 2 else v[:-1]) if isinstance(v, torch.Tensor) \
            else [v]
    value = data.draw(st.sampled_from(ELEMENTS), label="element")
    where = data.draw(st.integers(0, 10_000), label="index")

    def set_element(v):
        if not isinstance(v, torch.Tensor) or v.numel() == 0:
            return value
        v = v.clone()
        v.view(-1)[where % v.numel()] = value
        return v
    return path, set_element


def key_name(path) -> str:
    strings = [p for p in path if isinstance(p, str)]
    return strings[-1] if strings else "state_dict"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_malformed_state_dicts_are_refused_or_round_trip(setup, data):
    _, saved, opt, own = setup
    opt.load_state_dict(own)  # a known state that differs from ``saved`` in every buffer
    path, fn = mutation(data, saved)
    bad = replaced(saved, path, fn)
    before = snapshot(opt)
    try:
        opt.load_state_dict(bad)
    except Exception as exc:  # noqa: BLE001 - the kind is asserted: a ValueError/TypeError naming the key
        assert isinstance(exc, (ValueError, TypeError)), (path, repr(exc))
        assert repr(key_name(path)) in str(exc) or key_name(path) in str(exc), (path, str(exc))
        assert same(snapshot(opt), before), f"refused load changed the optimizer: {path}"
    else:
        assert same(opt.state_dict(), bad), f"accepted load did not round-trip: {path}"


# ---- the same property for the reshardable format (graphstep.checkpoint) ------------------------------
@pytest.fixture(scope="module", params=sorted(CONFIGS))
def sharded_setup(request):
    model_a, opt_a = build(request.param, seed=0)
    train(model_a, opt_a, 3)
    _, opt_b = build(request.param, seed=1)
    return (gs.checkpoint.sharded_state_dict(opt_a, snapshot=True), opt_b,
            gs.checkpoint.sharded_state_dict(opt_b, snapshot=True))


def decoded(sd):
    """The sharded dict with its JSON entries decoded (so mutations can reach inside them)."""
    json_keys = (gs.checkpoint.sharded.GROUPS_KEY, gs.checkpoint.sharded.META_KEY)
    return {k: gs.checkpoint.sharded.decode_json(v, k) if k in json_keys else v for k, v in sd.items()}


def encoded(sd):
    json_keys = (gs.checkpoint.sharded.GROUPS_KEY, gs.checkpoint.sharded.META_KEY)
    return {k: gs.checkpoint.sharded.encode_json(v) if k in json_keys and not isinstance(v, torch.Tensor)
            else v for k, v in sd.items()}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_malformed_sharded_state_dicts_are_refused_or_round_trip(sharded_setup, data):
    saved, opt, own = sharded_setup
    opt.load_sharded_state_dict(own)
    plain = decoded(saved)
    path, fn = mutation(data, plain)
    bad = replaced(plain, path, fn)
    try:
        bad_sd = encoded(bad)
    except TypeError:  # a tensor inside a JSON entry: not a dict a checkpoint can hold
        assume(False)
    before = snapshot(opt)
    try:
        opt.load_sharded_state_dict(bad_sd)
    except Exception as exc:  # noqa: BLE001 - the kind is asserted: a ValueError/TypeError naming the key
        assert isinstance(exc, (ValueError, TypeError)), (path, repr(exc))
        names = {str(path[0]), key_name(path)}
        assert any(n in str(exc) for n in names), (path, str(exc))
        assert same(snapshot(opt), before), f"refused load changed the optimizer: {path}"
    else:
        assert same(decoded(gs.checkpoint.sharded_state_dict(opt)), bad), f"no exact round trip: {path}"


@pytest.mark.parametrize("scale", [3e38, 1e-39])
def test_a_scale_the_scaler_refuses_is_refused_before_anything_is_copied(scale):
    # A finite fp32 scale outside [2**-126, 2**127] passed the old checks, then the scaler refused it
    # after the main params and the step had been copied.
    model = tiny_transformer()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, loss_scale=1024.0, capture="eager"), model)
    for step in range(2):
        opt.zero_grad()
        opt.scale_loss(loss_fn(model, step)).backward()
        opt.step()
    saved = opt.state_dict()
    for step in range(2, 4):
        opt.zero_grad()
        opt.scale_loss(loss_fn(model, step)).backward()
        opt.step()
    before = opt.state_dict()
    saved["scaler"] = {"scale": torch.tensor(scale)}
    with pytest.raises(ValueError, match="scaler"):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert torch.equal(before["step"], after["step"])
    assert all(torch.equal(a, b) for a, b in zip(before["main_params"], after["main_params"]))


def _wrapped(model):
    return gs.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), capture="eager")


def _engine_over(model):
    return gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, capture="eager"), model)


@pytest.mark.parametrize("build", [_engine_over, _wrapped], ids=["get_optimizer", "wrap"])
def test_torchs_state_dict_hooks_run_around_graphsteps_formats(build):
    # Frameworks add entries through these hooks; torch's own optimizers run all four.
    model = torch.nn.Linear(4, 4)
    opt = build(model)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 7})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("load pre", sd.pop("extra"))))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    saved = opt.state_dict()
    assert saved["extra"] == 7
    opt.load_state_dict(saved)  # the pre-hook takes the extra entry out of a copy: the load sees none
    assert calls == ["save pre", ("load pre", 7), "load post"] and saved["extra"] == 7


@pytest.mark.parametrize("fmt", ["flat", "sharded"])
def test_a_group_setting_fixed_at_build_is_refused_at_load_not_at_the_next_step(fmt):
    # Loaded, the next step would refuse the group ("fixed at build"): the load refuses it and changes nothing.
    def build(nesterov):
        model = torch.nn.Linear(4, 4)
        return model, gs.get_optimizer(gs.OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.9,
                                                          sgd_nesterov=nesterov, capture="eager"), model)
    model, saved = build(True)
    model(torch.randn(2, 4)).sum().backward()
    saved.step()
    _, live = build(False)
    before = copy.deepcopy(live.state_dict())
    with pytest.raises(ValueError, match="nesterov=True: fixed at build"):
        if fmt == "flat":
            live.load_state_dict(saved.state_dict())
        else:
            live.load_sharded_state_dict(saved.sharded_state_dict())
    assert live.param_groups[0]["nesterov"] is False
    after = live.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(before["main_params"], after["main_params"]))
