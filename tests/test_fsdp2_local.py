"""An FSDP2 model's optimizer in one process (a one-rank gloo group; the multi-rank runs are
tests/distributed/test_fsdp2.py): FSDP2's tensors stay bound to the flat buffers whatever the user does to the
grads and params, torch's state-dict format round-trips, and what graphstep does not take is refused by name."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import graphstep as gs
from _parity import assert_bitwise

pytestmark = pytest.mark.usefixtures("one_rank_group")


# Every param's size a multiple of 16: the bitwise claims against torch's fused AdamW hold on every vector
# width only then (its CPU kernel rounds a tensor's last numel % width elements in a scalar loop; tests/_parity.py).
IN, HIDDEN, OUT = 16, 16, 16


def model(seed: int = 0, dtype=torch.float32, mp_dtype=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT)).to(dtype)
    policy = MixedPrecisionPolicy(param_dtype=mp_dtype) if mp_dtype is not None else MixedPrecisionPolicy()
    for layer in (m[0], m[2]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(m, mp_policy=policy)
    return m


def config(**fields) -> gs.OptimizerConfig:
    return gs.OptimizerConfig(**{"lr": 1e-2, "weight_decay": 0.1, "clip_grad": 0.0, "capture": "eager",
                                 "kernel": "fused", **fields})


def backward(m, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, IN, generator=generator), torch.randn(4, OUT, generator=generator)
    F.mse_loss(m(x).float(), y).backward()


def train(pairs, steps) -> None:
    """(model, graphstep optimizer) pairs, stepped together on the same data."""
    for step in steps:
        for m, opt in pairs:
            backward(m, step)
            opt.step()
            opt.zero_grad()


def local(m) -> list:
    return [p._local_tensor.detach().clone() for p in m.parameters()]


def named_local(m) -> list:
    return [(name, p._local_tensor.detach().clone()) for name, p in m.named_parameters()]


def pair():
    """The same FSDP2 model twice: one for graphstep, one for torch's fused AdamW (the bitwise oracle)."""
    ours, theirs = model(), model()
    opt = gs.get_optimizer(config(), ours, config_overrides={})
    reference = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    return ours, opt, theirs, reference


def test_params_and_grads_are_views_of_the_flat_buffers():
    m = model()
    opt = gs.get_optimizer(config(), m)
    base = opt.buffers.param_flat[0].untyped_storage().data_ptr()
    grads = opt.buffers.grad_flat[0].untyped_storage().data_ptr()
    for p in m.parameters():
        assert p._local_tensor.untyped_storage().data_ptr() == base
        assert p.grad._local_tensor.untyped_storage().data_ptr() == grads
    backward(m, 0)
    assert all(p.grad._local_tensor.untyped_storage().data_ptr() == grads for p in m.parameters())
    assert opt.buffers.grad_flat[0].abs().sum() > 0  # FSDP2 accumulated into them


@pytest.mark.parametrize("user_zeroing", ["opt.zero_grad", "model.zero_grad", "p.grad = None"])
def test_grads_the_user_set_to_none_are_taken_back_and_steps_stay_bitwise_torchs(user_zeroing):
    ours, opt, theirs, reference = pair()
    for step in range(4):
        backward(ours, step)
        backward(theirs, step)
        opt.step()
        reference.step()
        reference.zero_grad()
        if user_zeroing == "opt.zero_grad":
            opt.zero_grad()
        elif user_zeroing == "model.zero_grad":
            ours.zero_grad()  # set_to_none: FSDP2 hands out fresh grads at the next backward
        else:
            for p in ours.parameters():
                p.grad = None
        assert_bitwise(named_local(ours), local(theirs), step=step, against="torch's fused AdamW")


def test_a_step_without_backward_after_the_grads_were_dropped_applies_zero_grads():
    ours, opt, theirs, reference = pair()
    backward(ours, 0)
    ours.zero_grad()  # every grad None
    opt.step()
    for p in theirs.parameters():
        p.grad = torch.zeros_like(p)
    reference.step()
    assert_bitwise(named_local(ours), local(theirs), against="torch's fused AdamW")


def test_params_moved_by_model_to_are_taken_back_without_a_recapture():
    m = model()
    opt = gs.get_optimizer(config(capture="graph", capture_warmup_steps=1), m)
    for step in range(3):
        backward(m, step)
        opt.step()
        opt.zero_grad()
    assert opt.captured
    before = local(m)
    m.to(torch.float64).to(torch.float32)  # a new storage for every param (FSDP2 re-pads its shards)
    moved = [p._local_tensor.untyped_storage().data_ptr() for p in m.parameters()]
    assert all(ptr != opt.buffers.param_flat[0].untyped_storage().data_ptr() for ptr in moved)
    backward(m, 3)
    opt.step()
    base = opt.buffers.param_flat[0].untyped_storage().data_ptr()
    assert all(p._local_tensor.untyped_storage().data_ptr() == base for p in m.parameters())
    assert opt.recaptures == 0 and opt.captured
    assert not all(torch.equal(a, b) for a, b in zip(local(m), before))  # the step reached the model


def test_torch_format_state_dict_round_trips_bitwise_into_another_optimizer():
    ours, opt, _, _ = pair()
    train([(ours, opt)], range(3))
    saved = opt.state_dict()
    assert set(saved) == {"state", "param_groups"}
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert type(saved["state"][0]["exp_avg"]).__name__ == "DTensor"
    copy = {"state": {k: {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for n, v in e.items()}
                      for k, e in saved["state"].items()},
            "param_groups": saved["param_groups"]}
    other = model(seed=3)
    other.load_state_dict(ours.state_dict())
    opt2 = gs.get_optimizer(config(), other, config_overrides={})
    opt2.load_state_dict(copy)
    train([(ours, opt), (other, opt2)], range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(local(other), local(ours)))
    assert float(opt2.tensors.step) == float(opt.tensors.step) == 5


def test_a_mismatched_state_dict_is_refused_and_changes_nothing():
    ours, opt, _, _ = pair()
    backward(ours, 0)
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["exp_avg"] = torch.zeros(2, 2)
    before = [t.clone() for t in opt.buffers.state["exp_avg"]]
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] has local shape \(2, 2\)"):
        opt.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(opt.buffers.state["exp_avg"], before))


def test_graphsteps_own_reshardable_format_points_at_torchs_api():
    _, opt, _, _ = pair()
    with pytest.raises(TypeError, match="torch.distributed.checkpoint: get_state_dict"):
        opt.sharded_state_dict()
    with pytest.raises(TypeError, match="get_state_dict"):
        gs.checkpoint.get_optimizer_state_dict(None, opt)


def test_fp16_config_scales_the_loss_dynamically_and_casts_nothing():
    m = model(mp_dtype=torch.float16)
    opt = gs.get_optimizer(config(fp16=True, initial_loss_scale=2.0 ** 10, hysteresis=1), m)
    assert all(p.dtype == torch.float32 for p in m.parameters())
    backward(m, 0)
    next(m.parameters()).grad._local_tensor.view(-1)[0] = float("inf")
    result = opt.step()
    assert not bool(result.update_successful) and float(opt.loss_scale) == 2.0 ** 9


def test_step_before_any_backward_warns_and_after_one_does_not():
    m = model()
    opt = gs.get_optimizer(config(), m)
    with pytest.warns(RuntimeWarning, match="before any backward"):
        opt.step()
    m2 = model()
    opt2 = gs.get_optimizer(config(), m2)
    backward(m2, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt2.step()


@pytest.mark.parametrize("fields, message", [
    (dict(optimizer="muon"), "muon_tp_mode='blockwise' would orthogonalise each rank's rows alone"),
    (dict(use_distributed_optimizer=True), "FSDP2 shards the params"),
    (dict(optimizer_cpu_offload=True), "CPU offload"),
    (dict(params_dtype=torch.bfloat16, bf16=True), "MixedPrecisionPolicy"),
])
def test_what_fsdp2_models_do_not_take_is_refused_by_name(fields, message):
    m = model()
    before = local(m)
    with pytest.raises(ValueError, match=message):
        gs.get_optimizer(config(**fields), m)
    assert all(torch.equal(a, b) for a, b in zip(local(m), before))


def test_sharded_params_below_fp32_and_params_outside_fully_shard_are_refused():
    with pytest.raises(ValueError, match="sharded in torch.bfloat16"):
        gs.get_optimizer(config(), model(dtype=torch.bfloat16))
    from torch.distributed.fsdp import fully_shard
    m = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Linear(5, 3))
    fully_shard(m[0])  # the root's own params stay plain
    with pytest.raises(ValueError, match="param '1.weight' is a plain tensor that fully_shard does not manage"):
        gs.get_optimizer(config(), m)


def test_process_groups_given_with_an_fsdp2_model_are_refused():
    import torch.distributed as dist
    with pytest.raises(ValueError, match="process_group given with an FSDP2 model"):
        gs.get_optimizer(config(), model(), process_group=dist.group.WORLD)


def test_a_changed_lr_reaches_the_captured_step_without_a_recapture():
    ours, theirs = model(), model()
    opt = gs.get_optimizer(config(capture="graph", capture_warmup_steps=1), ours, config_overrides={})
    reference = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(6):
        for group in (*opt.param_groups, *reference.param_groups):
            group["lr"] = 1e-2 / (1 + step)  # a schedule: the hyperparameters are device tensors
        backward(ours, step)
        backward(theirs, step)
        opt.step()
        opt.zero_grad()
        reference.step()
        reference.zero_grad()
    assert opt.captured and opt.recaptures == 0
    assert_bitwise(named_local(ours), local(theirs), against="torch's fused AdamW")


@pytest.mark.parametrize("moments", [torch.bfloat16, torch.float8_e4m3fn])
def test_moments_below_fp32_round_trip_through_torchs_format_as_fp32_values(moments):
    fields = dict(use_precision_aware_optimizer=True, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    ours = model()
    opt = gs.get_optimizer(config(**fields), ours, config_overrides={})
    assert opt.buffers.state["exp_avg"][0].dtype != torch.float32  # stored below fp32
    train([(ours, opt)], range(3))
    saved = opt.state_dict()
    values = {k: {n: v.full_tensor().clone() for n, v in e.items() if n != "step"} for k, e in saved["state"].items()}
    assert all(v.dtype == torch.float32 for e in values.values() for v in e.values())
    assert any(float(v.abs().max()) > 0 for e in values.values() for v in e.values())
    other = model(seed=3)
    other.load_state_dict(ours.state_dict())
    opt2 = gs.get_optimizer(config(**fields), other, config_overrides={})
    opt2.load_state_dict(saved)
    again = {k: {n: v.full_tensor() for n, v in e.items() if n != "step"}
             for k, e in opt2.state_dict()["state"].items()}
    assert all(torch.equal(again[k][n], values[k][n]) for k in values for n in values[k])  # encoded the same
    assert all(torch.equal(a, b) for a, b in zip(opt2.buffers.state["exp_avg"], opt.buffers.state["exp_avg"]))
    train([(ours, opt), (other, opt2)], range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(local(other), local(ours)))


def test_grads_of_a_backward_before_the_build_are_stepped_on_as_torch_does():
    ours, theirs = model(), model()
    backward(ours, 0)
    backward(theirs, 0)
    opt = gs.get_optimizer(config(), ours, config_overrides={})  # biases decay too, as in torch's AdamW
    reference = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "step() ran before any backward"
        opt.step()
    reference.step()
    assert_bitwise(named_local(ours), local(theirs), against="torch's fused AdamW")


def test_a_sharded_param_frozen_after_the_build_is_refused_by_name():
    # The watch reads the model's DTensor params, not the local shards the buffers hold.
    m = model()
    opt = gs.get_optimizer(config(), m, config_overrides={})
    m[2].weight.requires_grad_(False)
    backward(m, 0)
    with pytest.raises(RuntimeError, match=r"'2\.weight' do not require grad"):
        opt.step()


def test_a_sharded_model_cast_after_the_build_is_refused_by_name():
    m = model()
    opt = gs.get_optimizer(config(), m, config_overrides={})
    m.to(torch.float64)
    with pytest.raises(ValueError, match=r"param '0\.weight' was cast to torch.float64"):
        opt.step()
    assert all(p.dtype == torch.float64 for p in m.parameters())


def test_torchs_state_dict_hooks_run_around_the_fsdp2_format():
    m = model()
    opt = gs.get_optimizer(config(), m, config_overrides={})
    backward(m, 0)
    opt.step()
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 7})
    seen = []
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(sd.pop("extra")))
    opt.load_state_dict(opt.state_dict())
    assert seen == [7]


def test_on_request_fsdp2s_binding_check_reads_no_param_between_requests(monkeypatch):
    from graphstep.native import param_checks
    m = model()
    opt = gs.get_optimizer(config(param_checks="on_request"), m)
    train([(m, opt)], range(1))
    reads = []
    read = param_checks.first_unbound
    monkeypatch.setattr(param_checks, "first_unbound", lambda tensors, **kw: (reads.append(len(tensors)),
                                                                              read(tensors, **kw))[1])
    train([(m, opt)], range(1, 3))
    assert not any(reads)  # neither FSDP2's bindings nor the requires_grad watch read a param
    opt.check_params()
    train([(m, opt)], range(3, 4))
    assert any(reads)
