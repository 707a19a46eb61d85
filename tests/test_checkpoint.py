"""graphstep.checkpoint on one process: the reshardable format, DCP save/load/async_save, a captured step
kept across a load, atomic saves (a killed save), and refusals that change nothing."""

import copy
import os
import pickle
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import graphstep as gs
from graphstep.checkpoint import sharded
from toy import loss_fn, relative_drift, tiny_transformer

ADAM = dict(optimizer="adam", lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95)
SGD = dict(optimizer="sgd", lr=0.05, sgd_momentum=0.9, weight_decay=0.1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine(model, **config):
    # Not _engine.make_engine (eager by default): these checkpoints come from the user's default config, capture="auto".
    return gs.get_optimizer(gs.OptimizerConfig(**config), model)


def train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        opt.scale_loss(loss_fn(model, step)).backward()
        opt.step()
        opt.zero_grad()


def per_param_state(opt):
    """{(kind, param name): this rank's slice, read back through the per-param views of the buffers}."""
    out = {}
    for owned in opt.layout.owned_ranges(opt.rank):
        place = opt.layout.params[owned.param]
        size = owned.param_end - owned.param_start
        for kind in sharded.state_kinds(opt):
            buf = opt.buffers.main_shard if kind == sharded.MAIN_PARAM else opt.buffers.state[kind]
            out[(kind, place.name)] = buf[place.buffer][owned.shard_start:owned.shard_start + size].clone()
    return out


def everything(opt):
    """Every byte a load may write (a refused load must leave it bitwise equal)."""
    return ([t.clone() for t in opt.buffers.param_flat], [t.clone() for t in opt.buffers.main_shard],
            {k: [t.clone() for t in v] for k, v in opt.buffers.state.items()}, opt.tensors.step.clone(),
            None if opt.scaler is None else opt.scaler.state_dict(),
            copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]),
            (opt.clip_grad, opt.grad_norm_skip_threshold))


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


# ---- round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [ADAM, SGD, dict(ADAM, fp16=True), dict(ADAM, bf16=True)],
                         ids=["adam", "sgd", "adam_fp16", "adam_bf16"])
def test_save_load_resumes_bitwise_at_the_same_layout(tmp_path, config):
    model = tiny_transformer()
    opt = engine(model, **config)
    train(model, opt, 4)
    gs.checkpoint.save(opt, tmp_path / "ckpt", model=model)
    saved = per_param_state(opt)
    train(model, opt, 4, start=4)

    fresh = tiny_transformer(seed=1).to(next(model.parameters()).dtype)
    opt2 = engine(fresh, **config)
    addresses = {k: t.data_ptr() for k, t in opt2.buffers.addresses().items()}
    gs.checkpoint.load(opt2, tmp_path / "ckpt", model=fresh)
    assert {k: t.data_ptr() for k, t in opt2.buffers.addresses().items()} == addresses  # in place
    assert_same(per_param_state(opt2), saved)
    train(fresh, opt2, 4, start=4)
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert_same(opt2.state_dict()["scaler"], opt.state_dict()["scaler"])


def test_load_into_another_bucket_layout(tmp_path):
    model, start = tiny_transformer(), None
    opt = engine(model, **ADAM)
    train(model, opt, 4)
    gs.checkpoint.save(opt, tmp_path / "ckpt")
    saved = per_param_state(opt)
    start = [p.detach().clone() for p in model.parameters()]
    train(model, opt, 6, start=4)

    fresh = tiny_transformer(seed=1)
    opt2 = engine(fresh, bucket_size=3000, **ADAM)  # several buckets: other offsets, other views
    assert len(opt2.layout.buckets) > len(opt.layout.buckets)
    gs.checkpoint.load(opt2, tmp_path / "ckpt")
    assert_same(per_param_state(opt2), saved)
    for a, b in zip(fresh.parameters(), start):
        assert torch.equal(a, b)  # the post-load publish: the model params are the loaded main params
    train(fresh, opt2, 6, start=4)
    assert relative_drift(list(fresh.parameters()), list(model.parameters()), start) < 1e-3


def test_sharded_state_dict_round_trip_in_memory_and_engine_methods():
    model = tiny_transformer()
    opt = engine(model, **ADAM)
    train(model, opt, 3)
    sd = opt.sharded_state_dict()
    assert f"optimizer.state.exp_avg_sq.{opt.layout.params[0].name}" in sd
    assert sd[f"optimizer.state.fp32_param.{opt.layout.params[0].name}"].shape == (opt.layout.params[0].numel,)
    assert sum(v.numel() for k, v in sd.items() if k.startswith("optimizer.state.fp32_param.")) == \
        sum(p.numel for p in opt.layout.params)  # no padding saved
    fresh = tiny_transformer(seed=1)
    opt2 = engine(fresh, **ADAM)
    opt2.load_sharded_state_dict(sd)
    assert_same(per_param_state(opt2), per_param_state(opt))
    got = gs.checkpoint.get_optimizer_state_dict(fresh, opt2)
    assert_same(got, opt2.sharded_state_dict())
    gs.checkpoint.set_optimizer_state_dict(fresh, opt2, sd)


def test_torchs_get_optimizer_state_dict_changes_nothing_even_with_grads_set_to_none():
    # torch's helper runs a zero-lr step on an optimizer whose .state is empty; graphstep's is not empty,
    # so the helper cannot advance the step or the moments while it reads the state.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = tiny_transformer()
    opt = engine(model, **ADAM)
    train(model, opt, 2)
    model.zero_grad(set_to_none=True)
    before = opt.state_dict()
    get_optimizer_state_dict(model, opt)
    after = opt.state_dict()
    assert torch.equal(before["step"], after["step"])
    for name in before["state"]:
        assert all(torch.equal(a, b) for a, b in zip(before["state"][name], after["state"][name]))


def test_flat_state_dict_still_round_trips_with_torch_save(tmp_path):
    model = tiny_transformer()
    opt = engine(model, **ADAM)
    train(model, opt, 3)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    train(model, opt, 3, start=3)
    fresh = tiny_transformer(seed=1)
    opt2 = engine(fresh, **ADAM)
    opt2.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    train(fresh, opt2, 3, start=3)
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)


# ---- a captured step survives a load -------------------------------------------------------------------
def test_captured_step_replays_after_a_load_without_recapture(tmp_path):
    source = tiny_transformer(seed=2)
    opt_src = engine(source, **ADAM)
    train(source, opt_src, 3)
    gs.checkpoint.save(opt_src, tmp_path / "ckpt")

    runs = {}
    for capture in ("graph", "eager"):
        model = tiny_transformer()
        opt = engine(model, capture=capture, capture_warmup_steps=1, **ADAM)
        train(model, opt, 3)  # warm-up, capture, replay
        count = opt.recaptures
        gs.checkpoint.load(opt, tmp_path / "ckpt")
        train(model, opt, 4, start=3)
        if capture == "graph":
            assert opt.captured and opt.capture_backend == "replay"
            assert opt.recaptures == count == 0
        runs[capture] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(runs["graph"], runs["eager"]):
        assert torch.equal(a, b)


# ---- async save ---------------------------------------------------------------------------------------
def test_async_save_holds_the_state_at_the_call_while_training_goes_on(tmp_path):
    model = tiny_transformer()
    opt = engine(model, **ADAM)
    train(model, opt, 3)
    at_call = per_param_state(opt)
    params_at_call = [p.detach().clone() for p in model.parameters()]
    future = gs.checkpoint.async_save(opt, tmp_path / "ckpt", model=model)
    train(model, opt, 3, start=3)  # steps run before the save is waited for
    assert future.result(timeout=60) is None
    assert not torch.equal(per_param_state(opt)[("exp_avg", "3.weight")], at_call[("exp_avg", "3.weight")])
    fresh = tiny_transformer(seed=1)
    opt2 = engine(fresh, **ADAM)
    gs.checkpoint.load(opt2, tmp_path / "ckpt", model=fresh)
    assert_same(per_param_state(opt2), at_call)
    assert float(opt2.tensors.step) == 3
    for a, b in zip(fresh.parameters(), params_at_call):
        assert torch.equal(a, b)


# ---- safety -------------------------------------------------------------------------------------------
def assert_refused_unchanged(opt, fn, match):
    before = everything(opt)
    with pytest.raises((ValueError, TypeError), match=match):
        fn()
    assert_same(everything(opt), before)


def test_checkpoint_of_another_model_is_refused_naming_the_param(tmp_path):
    model = tiny_transformer()
    opt = engine(model, **ADAM)
    train(model, opt, 2)
    gs.checkpoint.save(opt, tmp_path / "ckpt", model=model)

    wider = torch.nn.Sequential(*list(tiny_transformer(seed=1).children())[:3], torch.nn.Linear(32, 65))
    opt_wide = engine(wider, **ADAM)
    wider(torch.randint(0, 64, (2, 8))).float().square().mean().backward()
    opt_wide.step()  # state that differs from a fresh optimizer's
    assert_refused_unchanged(opt_wide, lambda: gs.checkpoint.load(opt_wide, tmp_path / "ckpt"), "'3.weight'")
    shorter = torch.nn.Sequential(*list(tiny_transformer(seed=1).children())[:3])
    opt_short = engine(shorter, **ADAM)
    assert_refused_unchanged(opt_short, lambda: gs.checkpoint.load(opt_short, tmp_path / "ckpt"), "'3.weight'")
    longer = torch.nn.Sequential(*tiny_transformer(seed=1).children(), torch.nn.Linear(64, 64))
    opt_long = engine(longer, **ADAM)
    assert_refused_unchanged(opt_long, lambda: gs.checkpoint.load(opt_long, tmp_path / "ckpt"), "'4.weight'")
    sgd_model = tiny_transformer(seed=1)
    opt_sgd = engine(sgd_model, **SGD)
    assert_refused_unchanged(opt_sgd, lambda: gs.checkpoint.load(opt_sgd, tmp_path / "ckpt"), "state")


def test_malformed_sharded_state_dicts_are_refused_with_nothing_changed():
    model = tiny_transformer()
    opt = engine(model, fp16=True, **ADAM)
    train(model, opt, 3)
    good = opt.sharded_state_dict(), None
    good = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in good[0].items()}
    target_model = tiny_transformer(seed=1).half()
    target = engine(target_model, fp16=True, **ADAM)
    name = opt.layout.params[3].name

    def mutated(key, fn):
        bad = dict(good)
        bad[key] = fn(bad[key]) if key in bad else None
        if bad[key] is None:
            del bad[key]
        return bad

    def meta_with(**changes):
        meta = sharded.decode_json(good[sharded.META_KEY], "meta")
        meta.update(changes)
        return sharded.encode_json(meta)

    def nan_at(t):
        t = t.clone()
        t[0] = float("nan")
        return t

    cases = [
        (mutated(f"optimizer.state.exp_avg.{name}", lambda t: t.to(torch.float64)), f"exp_avg.{name}"),
        (mutated(f"optimizer.state.fp32_param.{name}", nan_at), f"fp32_param.{name}"),
        (mutated(f"optimizer.state.exp_avg_sq.{name}", lambda t: t[:-1]), f"exp_avg_sq.{name}"),
        (mutated(f"optimizer.state.exp_avg_sq.{name}", lambda t: None), f"exp_avg_sq.{name}"),
        (mutated(sharded.META_KEY, lambda t: meta_with(version=99)), "version"),
        (mutated(sharded.META_KEY, lambda t: meta_with(clip_grad="big")), "clip_grad"),
        (mutated(sharded.STEP_KEY, lambda t: torch.tensor(-1.0)), "step"),
        (mutated("optimizer.scaler.scale", lambda t: torch.tensor(float("inf"))), "scale"),
        (mutated("optimizer.scaler.growth_tracker", lambda t: None), "growth_tracker"),
        (mutated(sharded.GROUPS_KEY, lambda t: sharded.encode_json(
            [dict(g, lr="fast") for g in sharded.decode_json(t, "g")])), "lr"),
        (mutated(sharded.GROUPS_KEY, lambda t: torch.tensor([1, 2], dtype=torch.uint8)), "param_groups"),
    ]
    for bad, key in cases:
        assert_refused_unchanged(target, lambda: target.load_sharded_state_dict(bad), key)
    target.load_sharded_state_dict(good)  # the unmutated dict loads
    assert_same(per_param_state(target), per_param_state(opt))


def test_unknown_version_and_pickled_entries_are_refused(tmp_path):
    model = tiny_transformer()
    opt = engine(model, **ADAM)
    sd = opt.sharded_state_dict()
    meta = sharded.decode_json(sd[sharded.META_KEY], "meta")
    meta["version"] = 2
    sd[sharded.META_KEY] = sharded.encode_json(meta)
    dcp.save(sd, checkpoint_id=str(tmp_path / "future"))
    assert_refused_unchanged(opt, lambda: gs.checkpoint.load(opt, tmp_path / "future"), "version")

    sd = opt.sharded_state_dict()
    sd["extra"] = {"a python": "object"}  # DCP pickles non-tensor values
    dcp.save(sd, checkpoint_id=str(tmp_path / "pickled"))
    assert_refused_unchanged(opt, lambda: gs.checkpoint.load(opt, tmp_path / "pickled"), "'extra.a python' is a pickled")


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_metadata_is_never_unpickled_beyond_dcp_classes(tmp_path, monkeypatch):
    model = tiny_transformer()
    opt = engine(model, **ADAM)
    gs.checkpoint.save(opt, tmp_path / "ckpt")
    with open(tmp_path / "ckpt" / ".metadata", "wb") as f:
        pickle.dump(_Exploit(), f)
    monkeypatch.chdir(tmp_path)
    assert_refused_unchanged(opt, lambda: gs.checkpoint.load(opt, tmp_path / "ckpt"), "posix.system|os.system")
    assert not os.path.exists(tmp_path / "PWNED")


_SAVER = textwrap.dedent("""
    import sys, torch, graphstep as gs
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))
    opt = gs.get_optimizer(gs.OptimizerConfig(optimizer="adam", lr=1e-3, kernel="fused"), model)
    print("ready", flush=True)
    while True:
        gs.checkpoint.save(opt, sys.argv[1])
""")


def writing(staged) -> bool:
    try:
        return any(f.suffix == ".distcp" for f in staged.iterdir())
    except FileNotFoundError:
        return False


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    model = tiny_transformer()
    opt = engine(model, **ADAM)
    train(model, opt, 2)
    path = tmp_path / "ckpt"
    gs.checkpoint.save(opt, path)
    saved = per_param_state(opt)

    # Another process keeps overwriting a checkpoint of another (bigger) model at the same path; kill it
    # while it writes. The path must still hold a complete checkpoint: ours, or (had a save committed) its.
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(path)], stdout=subprocess.PIPE, env=env)
    try:
        assert select.select([proc.stdout], [], [], 90)[0], "the saver did not start within 90 s"
        assert proc.stdout.readline().strip() == b"ready"
        # The saver saves in a loop until killed, so it reaches a write unless it dies first.
        while not writing(tmp_path / "ckpt.saving"):
            assert proc.poll() is None, "the saver exited before it started writing"
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert (tmp_path / "ckpt.saving").exists()  # killed mid-write: the partial save is aside
    fresh = tiny_transformer(seed=1)
    opt2 = engine(fresh, **ADAM)
    gs.checkpoint.load(opt2, path)  # the previous checkpoint, complete
    assert_same(per_param_state(opt2), saved)
    gs.checkpoint.save(opt2, path)  # the next save clears the partial one and commits
    assert not (tmp_path / "ckpt.saving").exists()


def test_a_save_interrupted_between_the_renames_falls_back_to_the_previous_checkpoint(tmp_path, monkeypatch):
    model = tiny_transformer()
    opt = engine(model, **ADAM)
    train(model, opt, 2)
    gs.checkpoint.save(opt, tmp_path / "ckpt")
    saved = per_param_state(opt)
    train(model, opt, 1, start=2)
    real_rename = os.rename

    def crash_on_second_rename(src, dst):
        if str(src).endswith("ckpt.saving"):  # graphstep's swap, after the old checkpoint was moved aside
            raise KeyboardInterrupt("killed between the renames")
        real_rename(src, dst)
    monkeypatch.setattr(gs.checkpoint.dcp.os, "rename", crash_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        gs.checkpoint.save(opt, tmp_path / "ckpt")
    monkeypatch.setattr(gs.checkpoint.dcp.os, "rename", real_rename)
    assert not (tmp_path / "ckpt").exists() and (tmp_path / "ckpt.old").exists()
    opt2 = engine(tiny_transformer(seed=1), **ADAM)
    with pytest.warns(UserWarning, match="interrupted"):
        gs.checkpoint.load(opt2, tmp_path / "ckpt")
    assert_same(per_param_state(opt2), saved)


def test_optimizer_state_is_a_dcp_stateful(tmp_path):
    model = tiny_transformer()
    opt = engine(model, fp16=True, **ADAM)
    train(model, opt, 3)
    dcp.save({"optimizer": gs.checkpoint.OptimizerState(opt)}, checkpoint_id=str(tmp_path / "dcp"))
    fresh = tiny_transformer(seed=1).half()
    opt2 = engine(fresh, fp16=True, bucket_size=3000, **ADAM)
    dcp.load({"optimizer": gs.checkpoint.OptimizerState(opt2)},
             storage_reader=gs.checkpoint.SafeFileSystemReader(str(tmp_path / "dcp")),
             planner=gs.checkpoint.SafeLoadPlanner())
    assert_same(per_param_state(opt2), per_param_state(opt))
    assert_same(opt2.scaler.state_dict(), opt.scaler.state_dict())
    assert opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
