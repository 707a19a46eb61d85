"""An FSDP2 model's optimizer in one process (a one-rank gloo group; 2 ranks: tests/distributed/
test_fsdp2_hooks_and_loads_sharded.py): hooks a user registers on the model's params after the build run beside the
engine's, and a load in torch's format is checked whole before anything is copied, so a bad checkpoint leaves
every buffer bitwise as it was (graphstep/fsdp2/optimizer.py, graphstep/fsdp2/state_dict.py)."""

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import graphstep as gs
from graphstep.checkpoint.state_dict import StateDictError

pytestmark = pytest.mark.usefixtures("one_rank_group")


def model(seed: int = 0):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    for layer in (m[0], m[2]):
        fully_shard(layer)
    fully_shard(m)
    return m


def config(**fields) -> gs.OptimizerConfig:
    return gs.OptimizerConfig(**{"lr": 1e-2, "weight_decay": 0.1, "clip_grad": 0.0, "capture": "eager",
                                 "kernel": "fused", **fields})


def backward(m, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 3, generator=generator)
    F.mse_loss(m(x), y).backward()


def trained(seed: int, steps, **fields):
    m = model(seed)
    opt = gs.get_optimizer(config(**fields), m, config_overrides={})
    for step in steps:
        backward(m, step)
        opt.step()
        opt.zero_grad()
    return m, opt


def local(m) -> list:
    return [p._local_tensor.detach().clone() for p in m.parameters()]


def _local(value):
    """A DTensor's local tensor; a plain tensor as it is."""
    return value._local_tensor if hasattr(value, "_local_tensor") else value


# ---- hooks the user registers on the model's params ---------------------------------------------------------
@pytest.mark.parametrize("registered", ["after the build", "before the build"])
def test_a_users_post_accumulate_grad_hook_runs_beside_the_engines_in_every_backward(registered):
    m = model()
    calls = []

    def register():
        for name, p in m.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: calls.append(name))

    if registered == "before the build":
        register()
    opt = gs.get_optimizer(config(), m, config_overrides={})
    if registered == "after the build":
        register()  # after the engine's own: FSDP2 iterates the param's hooks while the engine's fire
    names = [name for name, _ in m.named_parameters()]
    for step in range(3):
        backward(m, step)  # both backwards before the first step (accumulation) and after it
        assert sorted(calls) == sorted(names), step
        calls.clear()
        if step:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a backward ran: no "step() ran before any backward"
                opt.step()
            opt.zero_grad()


def test_the_engines_grad_arrival_hooks_are_gone_after_the_first_step_and_after_close():
    m = model()
    hooks = lambda: [len(p._post_accumulate_grad_hooks or {}) for p in m.parameters()]  # noqa: E731
    opt = gs.get_optimizer(config(), m, config_overrides={})
    assert hooks() == [1] * 4
    backward(m, 0)
    backward(m, 1)
    opt.step()
    assert hooks() == [0] * 4  # later backwards pay nothing for them
    m2 = model(seed=1)
    other = gs.get_optimizer(config(), m2, config_overrides={})
    other.close()
    assert [len(p._post_accumulate_grad_hooks or {}) for p in m2.parameters()] == [0] * 4


def test_steps_with_a_users_hook_registered_after_the_build_equal_those_without():
    (ours, opt), (twin, twin_opt) = [trained(seed=0, steps=()) for _ in range(2)]
    for p in ours.parameters():
        p.register_post_accumulate_grad_hook(lambda p: None)
    for step in range(3):
        for m, o in ((ours, opt), (twin, twin_opt)):
            backward(m, step)
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(local(ours), local(twin)))


# ---- loads: all or nothing ------------------------------------------------------------------------------------
def snapshot(m, opt) -> dict:
    """Every byte the optimizer owns or steps (moments, main params, step, scaler, groups) and the model's
    local shards."""
    buffers = opt.buffers
    tensors = [*buffers.param_flat, *buffers.main_shard, *(t for ts in buffers.state.values() for t in ts),
               opt.tensors.step, *local(m)]
    if opt.scaler is not None:
        tensors += list(opt.scaler.state_dict().values())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"tensors": [t.detach().clone() for t in tensors], "groups": groups,
            "thresholds": (opt.clip_grad, opt.grad_norm_skip_threshold)}


def assert_unchanged(before: dict, after: dict) -> None:
    assert len(before["tensors"]) == len(after["tensors"])
    for i, (a, b) in enumerate(zip(before["tensors"], after["tensors"])):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"tensor {i} changed"
    assert before["groups"] == after["groups"] and before["thresholds"] == after["thresholds"]


def _set_local(value, index, number):
    """A copy of state tensor ``value`` (a DTensor or a plain tensor) with element ``index`` set to ``number``."""
    value = value.detach().clone()
    target = value._local_tensor if hasattr(value, "_local_tensor") else value
    target.view(-1)[index] = number
    return value


def _every_step(state_dict, value):
    for entry in state_dict["state"].values():
        entry["step"] = value


def _last_entry(state_dict):
    return state_dict["state"][list(state_dict["state"])[-1]]


# (name, edit of a valid state dict, what the refusal must say). Each bad value sits in the last param's entry
# (or in every entry, for the step), after entries a load that copies as it checks would already have written.
BAD = [
    ("step int", lambda sd: _every_step(sd, 3), r"\['step'\] must be a tensor, got int"),
    ("step str", lambda sd: _every_step(sd, "3"), r"\['step'\] must be a tensor, got str"),
    ("step None", lambda sd: _every_step(sd, None), r"\['step'\] must be a tensor, got NoneType"),
    ("step list", lambda sd: _every_step(sd, [3.0]), r"\['step'\] must be a tensor, got list"),
    ("step shape (2,)", lambda sd: _every_step(sd, torch.tensor([3.0, 3.0])), r"\['step'\] has shape \(2,\)"),
    ("step int64", lambda sd: _every_step(sd, torch.tensor(3)), r"\['step'\] has dtype torch.int64"),
    ("step nan", lambda sd: _every_step(sd, torch.tensor(math.nan)), r"\['step'\] holds NaN or inf"),
    ("step inf", lambda sd: _every_step(sd, torch.tensor(math.inf)), r"\['step'\] holds NaN or inf"),
    ("step negative", lambda sd: _every_step(sd, torch.tensor(-1.0)), r"\['step'\] is -1.0: must be a non-neg"),
    ("step fractional", lambda sd: _every_step(sd, torch.tensor(2.5)), r"\['step'\] is 2.5: must be a non-neg"),
    ("steps differ", lambda sd: _last_entry(sd).update(step=torch.tensor(9.0)), r"\['step'\] is 9.0, .* 3.0"),
    ("exp_avg nan", lambda sd: _last_entry(sd).update(exp_avg=_set_local(_last_entry(sd)["exp_avg"], 1, math.nan)),
     r"'exp_avg'\] \(param '2.bias'\) holds NaN or inf"),
    ("exp_avg inf", lambda sd: _last_entry(sd).update(exp_avg=_set_local(_last_entry(sd)["exp_avg"], 0, -math.inf)),
     r"'exp_avg'\] \(param '2.bias'\) holds NaN or inf"),
    ("exp_avg_sq negative",
     lambda sd: _last_entry(sd).update(exp_avg_sq=_set_local(_last_entry(sd)["exp_avg_sq"], 2, -1e-3)),
     r"'exp_avg_sq'\] \(param '2.bias'\) holds negative values"),
    ("exp_avg_sq nan",
     lambda sd: _last_entry(sd).update(exp_avg_sq=_set_local(_last_entry(sd)["exp_avg_sq"], 2, math.nan)),
     r"'exp_avg_sq'\] \(param '2.bias'\) holds NaN or inf"),
    ("exp_avg float64", lambda sd: _last_entry(sd).update(exp_avg=_last_entry(sd)["exp_avg"].double()),
     r"'exp_avg'\] \(param '2.bias'\) has dtype torch.float64"),
    ("exp_avg a list", lambda sd: _last_entry(sd).update(exp_avg=[0.0, 0.0, 0.0]),
     r"'exp_avg'\] \(param '2.bias'\) must be a tensor, got list"),
    ("an entry not a dict", lambda sd: sd["state"].update({list(sd["state"])[-1]: 7}), r"must be a dict, got int"),
    ("clip_grad nan", lambda sd: [g["graphstep"].update(clip_grad=math.nan) for g in sd["param_groups"]],
     r"\['clip_grad'\] is nan: must be finite"),
    ("lr nan", lambda sd: [g.update(lr=math.nan) for g in sd["param_groups"]], r"\['lr'\] is nan: must be finite"),
    ("betas a str", lambda sd: [g.update(betas="0.9") for g in sd["param_groups"]],
     r"\['betas'\] must be a sequence like"),
    ("amsgrad on", lambda sd: [g.update(amsgrad=True) for g in sd["param_groups"]],
     r"amsgrad=True is an option of torch's optimizers that graphstep's update does not implement"),
    ("a scaler's state", lambda sd: [g["graphstep"].update(loss_scaler={"scale": torch.tensor(2.0)})
                                     for g in sd["param_groups"]], r"holds loss-scaler state"),
]


def source_state_dict(torch_api: bool) -> dict:
    """A valid state dict of another trained optimizer (other values than the target's, step 3), detached from
    its buffers: graphstep's own ``state_dict()`` or torch's ``get_optimizer_state_dict`` (FQN keys)."""
    m, opt = trained(seed=5, steps=range(10, 13))
    if torch_api:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        saved = get_optimizer_state_dict(m, opt)
    else:
        saved = opt.state_dict()
    state = {k: {n: v.detach().clone() for n, v in e.items()} for k, e in saved["state"].items()}
    return {"state": state, "param_groups": saved["param_groups"]}


def _load(how: str, m, opt, state_dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, set_state_dict
    if how == "opt.load_state_dict":
        opt.load_state_dict(state_dict)
    elif how == "set_optimizer_state_dict":
        set_optimizer_state_dict(m, opt, state_dict)
    else:
        set_state_dict(m, opt, model_state_dict=m.state_dict(), optim_state_dict=state_dict)


LOADS = ["opt.load_state_dict", "set_optimizer_state_dict", "set_state_dict"]


@pytest.mark.parametrize("how", LOADS)
def test_a_good_state_dict_loads_and_the_steps_continue_as_the_source_optimizers(how):
    m, opt = trained(seed=0, steps=range(2))
    src_m, src_opt = trained(seed=5, steps=range(10, 13))
    saved = source_state_dict(torch_api=how != "opt.load_state_dict")
    m.load_state_dict(src_m.state_dict())
    _load(how, m, opt, saved)
    assert float(opt.tensors.step) == 3
    for both in ((m, opt), (src_m, src_opt)):
        backward(both[0], 20)
        both[1].step()
    assert all(torch.equal(a, b) for a, b in zip(local(m), local(src_m)))


@pytest.mark.parametrize("how", LOADS)
@pytest.mark.parametrize("name, edit, message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_state_dict_is_refused_naming_the_field_and_changes_nothing(how, name, edit, message):
    m, opt = trained(seed=0, steps=range(2))
    saved = source_state_dict(torch_api=how != "opt.load_state_dict")
    edit(saved)
    before = snapshot(m, opt)
    with pytest.raises((ValueError, TypeError, RuntimeError, AttributeError, KeyError)) as refused:
        _load(how, m, opt, saved)
    assert_unchanged(before, snapshot(m, opt))
    if how == "opt.load_state_dict":  # torch's API may refuse some inputs itself, in its own words
        assert refused.type is StateDictError
        assert re.search(message, str(refused.value)), str(refused.value)


@pytest.mark.parametrize("how", LOADS)
def test_a_refused_load_through_torchs_api_names_the_param_and_field(how):
    m, opt = trained(seed=0, steps=range(2))
    saved = source_state_dict(torch_api=how != "opt.load_state_dict")
    entry = _last_entry(saved)
    entry["exp_avg_sq"] = _set_local(entry["exp_avg_sq"], 0, -1.0)
    before = snapshot(m, opt)
    with pytest.raises(ValueError, match=r"'exp_avg_sq'\] \(param '2.bias'\) holds negative values"):
        _load(how, m, opt, saved)
    assert_unchanged(before, snapshot(m, opt))


def test_a_refused_load_leaves_the_next_step_as_it_would_have_been():
    m, opt = trained(seed=0, steps=range(2))
    twin_m, twin_opt = trained(seed=0, steps=range(2))
    saved = source_state_dict(torch_api=False)
    _last_entry(saved)["exp_avg"] = _set_local(_last_entry(saved)["exp_avg"], 0, math.nan)
    with pytest.raises(ValueError):
        opt.load_state_dict(saved)
    for pair in ((m, opt), (twin_m, twin_opt)):
        backward(pair[0], 2)
        pair[1].step()
    assert all(torch.equal(a, b) for a, b in zip(local(m), local(twin_m)))
    assert all(bool(torch.isfinite(p).all()) for p in local(m))


def test_a_torch_adamw_state_dict_loads_its_moments_and_step_and_keeps_graphsteps_thresholds():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    theirs = model(seed=5)
    reference = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        backward(theirs, step)
        reference.step()
    m, opt = trained(seed=0, steps=range(2), clip_grad=1.0)
    set_optimizer_state_dict(m, opt, get_optimizer_state_dict(theirs, reference))
    loaded = get_optimizer_state_dict(m, opt)
    expected = get_optimizer_state_dict(theirs, reference)
    for fqn, entry in expected["state"].items():
        for name, value in entry.items():
            assert torch.equal(_local(loaded["state"][fqn][name]), _local(value)), (fqn, name)
    assert float(opt.tensors.step) == 3 and opt.clip_grad == 1.0
    assert opt.param_groups[0]["fused"] is True  # torch's own keys are set as torch sets them
    backward(m, 3)
    opt.step()  # and the next step takes them


# ---- dcp.load into the state dict get_state_dict returned ----------------------------------------------------
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_load_of_a_damaged_checkpoint_into_torchs_state_dict_changes_nothing(tmp_path):
    # torch's flow loads in place into what get_state_dict returned: when that was the live buffers, a damaged
    # checkpoint was in the state before set_state_dict could refuse it.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    m, opt = trained(0, range(2))
    _, optim_sd = get_state_dict(m, opt)
    for entry in optim_sd["state"].values():
        _local(entry["exp_avg"]).fill_(float("nan"))
    dcp.save({"optim": optim_sd}, checkpoint_id=tmp_path)  # a checkpoint whose first moments are NaN
    m, opt = trained(0, range(2))
    before = snapshot(m, opt)
    model_sd, optim_sd = get_state_dict(m, opt)
    dcp.load({"optim": optim_sd}, checkpoint_id=tmp_path)  # into torch's state dict, in place
    with pytest.raises(StateDictError, match="NaN or inf"):
        set_state_dict(m, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert_unchanged(before, snapshot(m, opt))
