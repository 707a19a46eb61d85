"""torch's checkpoint API on a graphstep optimizer of a plain model, one process: ``get_state_dict`` /
``set_state_dict`` (and the optimizer-only forms) give and take torch's optimizer format, a DCP round trip
resumes bitwise without a recapture, and a load is validated whole before anything is copied.

The oracle for the values is graphstep's own reshardable format (``sharded_state_dict``: per param, flattened),
itself held against torch.optim elsewhere; for the resume, the uninterrupted run. Multi-rank cases (DDP, the
distributed optimizer resharding 2 -> 1, layer-wise, experts): tests/distributed/test_torch_state_dict_resharding.py.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, get_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)

import graphstep as gs
from graphstep.checkpoint import sharded
from toy import loss_fn, tiny_transformer

pytestmark = pytest.mark.usefixtures("one_rank_group")

ADAM = dict(optimizer="adam", lr=3e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, clip_grad=0.5)
SGD = dict(optimizer="sgd", lr=0.05, weight_decay=1e-3, sgd_momentum=0.9, clip_grad=0.5)


def build(seed: int = 0, dtype=torch.float32, **config):
    model = tiny_transformer(seed, dtype=dtype)
    fields = {**ADAM, "capture": "eager", **config}
    return model, gs.get_optimizer(gs.OptimizerConfig(**fields), model)


def train(model, opt, start: int, steps: int) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        opt.scale_loss(loss_fn(model, step)).backward()
        opt.step()
    opt.finish_param_gather()


def params(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


def flat_format(opt) -> dict:
    """``opt.state_dict()`` (graphstep's flat format), every tensor cloned."""
    return {k: _clone(v) for k, v in opt.state_dict().items()}


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# ---- the format -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [ADAM, SGD], ids=["adam", "sgd"])
def test_get_state_dict_gives_torchs_optimizer_format(config):
    model, opt = build(**config)
    train(model, opt, 0, 3)
    model_sd, optim_sd = get_state_dict(model, opt)
    names = dict(model.named_parameters())
    assert set(model_sd) == set(model.state_dict())
    assert set(optim_sd) == {"state", "param_groups"}
    assert set(optim_sd["state"]) == set(names)  # keyed by FQN
    assert sorted(n for g in optim_sd["param_groups"] for n in g["params"]) == sorted(names)
    kinds = ("exp_avg", "exp_avg_sq") if config["optimizer"] == "adam" else ("momentum_buffer",)
    ours = opt.sharded_state_dict()  # graphstep's own per-param format: the oracle for the values
    for name, entry in optim_sd["state"].items():
        assert set(entry) == {"step", *kinds}, name
        assert torch.equal(entry["step"], opt.tensors.step)
        for kind in kinds:
            value = entry[kind]
            assert type(value) is torch.Tensor and value.shape == names[name].shape, (name, kind)
            assert torch.equal(value.reshape(-1), ours[sharded.state_key(kind, name)]), (name, kind)
    for saved, live in zip(optim_sd["param_groups"], opt.param_groups):
        assert saved["lr"] == live["lr"] and saved["weight_decay"] == live["weight_decay"]
    alone = get_optimizer_state_dict(model, opt)
    assert same(alone, optim_sd)


def test_the_state_dict_is_a_copy_and_opt_state_dict_keeps_graphsteps_flat_format():
    model, opt = build()
    train(model, opt, 0, 2)
    _, optim_sd = get_state_dict(model, opt)
    before = {k: {n: t.clone() for n, t in e.items()} for k, e in optim_sd["state"].items()}
    train(model, opt, 2, 1)  # training on does not move what was handed out
    assert same({k: dict(e) for k, e in optim_sd["state"].items()}, before)
    assert opt.state_dict()["format"] == "graphstep/1"  # called by the user: graphstep's own format, as before


def test_bf16_params_carry_their_fp32_main_params():
    model, opt = build(dtype=torch.bfloat16, bf16=True)
    train(model, opt, 0, 2)
    _, optim_sd = get_state_dict(model, opt)
    ours = opt.sharded_state_dict()
    for name, p in model.named_parameters():
        main = optim_sd["state"][name]["fp32_param"]
        assert main.dtype == torch.float32 and main.shape == p.shape
        assert torch.equal(main.reshape(-1), ours[sharded.state_key("fp32_param", name)])


def test_torchs_init_step_never_runs_even_with_grads_set_to_none():
    # torch's helper runs a zero-lr step on an optimizer whose .state is empty: graphstep's never is.
    model, opt = build()
    train(model, opt, 0, 2)
    model.zero_grad(set_to_none=True)
    before = flat_format(opt)
    get_optimizer_state_dict(model, opt)
    assert same(flat_format(opt), before)


# ---- round trips ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("capture", ["eager", "graph"])
def test_dcp_round_trip_resumes_bitwise_without_a_recapture(tmp_path, capture):
    model, opt = build(capture=capture, capture_warmup_steps=1)
    train(model, opt, 0, 3)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    train(model, opt, 3, 3)  # the uninterrupted run
    fresh, opt2 = build(seed=1, capture=capture, capture_warmup_steps=1)
    train(fresh, opt2, 0, 2)  # another state, and (capture="graph") a captured step
    recaptures = opt2.recaptures
    model_sd2, optim_sd2 = get_state_dict(fresh, opt2)
    dcp.load({"model": model_sd2, "optim": optim_sd2}, checkpoint_id=str(tmp_path))
    set_state_dict(fresh, opt2, model_state_dict=model_sd2, optim_state_dict=optim_sd2)
    train(fresh, opt2, 3, 3)
    assert all(torch.equal(a, b) for a, b in zip(params(fresh), params(model)))
    assert same(flat_format(opt2), flat_format(opt))
    assert opt2.recaptures == recaptures
    if capture == "graph":
        assert opt2.captured


@pytest.mark.parametrize("config", [dict(dtype=torch.bfloat16, bf16=True),
                                    dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5),
                                    SGD], ids=["bf16", "offload", "sgd"])
def test_round_trip_in_memory_resumes_bitwise(config):
    dtype = config.get("dtype", torch.float32)
    fields = {k: v for k, v in config.items() if k != "dtype"}
    model, opt = build(dtype=dtype, **fields)
    train(model, opt, 0, 3)
    model_sd, optim_sd = get_state_dict(model, opt)
    model_sd = {k: v.clone() for k, v in model_sd.items()}
    train(model, opt, 3, 3)
    fresh, opt2 = build(seed=1, dtype=dtype, **fields)
    train(fresh, opt2, 0, 1)
    set_state_dict(fresh, opt2, model_state_dict=model_sd, optim_state_dict=optim_sd)
    train(fresh, opt2, 3, 3)
    assert all(torch.equal(a, b) for a, b in zip(params(fresh), params(model)))
    assert same(flat_format(opt2), flat_format(opt))


def test_optimizer_only_round_trip_and_load_state_dict_take_torchs_format():
    model, opt = build()
    train(model, opt, 0, 3)
    optim_sd = get_optimizer_state_dict(model, opt)
    want = flat_format(opt)
    fresh, opt2 = build(seed=1)
    fresh.load_state_dict(model.state_dict())
    set_optimizer_state_dict(fresh, opt2, optim_sd)
    assert same(flat_format(opt2), want)
    fresh3, opt3 = build(seed=2)
    opt3.load_state_dict(optim_sd)  # torch's format, FQN keys, straight into load_state_dict
    assert same({k: v for k, v in flat_format(opt3).items() if k != "main_params"},
                {k: v for k, v in want.items() if k != "main_params"})


# ---- refusals: validated whole, nothing copied ----------------------------------------------------------
def _first(optim_sd, kind):
    name = next(iter(optim_sd["state"]))
    return optim_sd["state"][name], name


def _nan_in_last(sd):
    name = list(sd["state"])[-1]
    sd["state"][name]["exp_avg"].view(-1)[-1] = float("nan")


def _negative_second_moment(sd):
    entry, _ = _first(sd, "exp_avg_sq")
    entry["exp_avg_sq"].view(-1)[0] = -1.0


def _other_step(sd):
    name = list(sd["state"])[-1]
    sd["state"][name]["step"] = sd["state"][name]["step"] + 1


def _wrong_shape(sd):
    entry, _ = _first(sd, "exp_avg")
    entry["exp_avg"] = entry["exp_avg"].reshape(-1)[:-1]


def _missing_kind(sd):
    entry, _ = _first(sd, "exp_avg")
    del entry["exp_avg_sq"]


def _unknown_kind(sd):
    entry, _ = _first(sd, "exp_avg")
    entry["max_exp_avg_sq"] = entry["exp_avg_sq"].clone()


def _bad_lr(sd):
    sd["param_groups"][-1]["lr"] = float("nan")


def _wrong_dtype(sd):
    entry, _ = _first(sd, "exp_avg")
    entry["exp_avg"] = entry["exp_avg"].double()


def _bad_clip(sd):
    for group in sd["param_groups"]:
        group["graphstep"]["clip_grad"] = -1.0


DAMAGES = {
    "nan": (_nan_in_last, "NaN or inf"),
    "negative": (_negative_second_moment, "negative"),
    "step": (_other_step, "one step count"),
    "shape": (_wrong_shape, "shape"),
    "missing": (_missing_kind, "exp_avg_sq"),
    "unknown": (_unknown_kind, "max_exp_avg_sq"),
    "lr": (_bad_lr, "lr"),
    "dtype": (_wrong_dtype, "dtype"),
    "clip": (_bad_clip, "clip_grad"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_state_dict_is_refused_whole_and_nothing_changes(damage):
    model, opt = build()
    train(model, opt, 0, 2)
    _, optim_sd = get_state_dict(model, opt)
    train(model, opt, 2, 1)  # the live state moves on: a load that copied anything would show
    change, match = DAMAGES[damage]
    change(optim_sd)
    before, at = flat_format(opt), params(model)
    with pytest.raises(ValueError, match=match):
        set_optimizer_state_dict(model, opt, optim_sd)
    assert same(flat_format(opt), before)
    assert all(torch.equal(a, b) for a, b in zip(params(model), at))


def test_full_state_dict_on_one_rank_round_trips():
    # One data-parallel rank holds every element: torch's full_state_dict / cpu_offload options apply as they are.
    model, opt = build()
    train(model, opt, 0, 2)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optim_sd = get_optimizer_state_dict(model, opt, options=options)
    want = flat_format(opt)
    train(model, opt, 2, 1)
    set_optimizer_state_dict(model, opt, optim_sd, options=options)
    assert same({k: v for k, v in flat_format(opt).items() if k != "main_params"},
                {k: v for k, v in want.items() if k != "main_params"})


def test_a_flattened_load_is_refused_with_the_way_that_works():
    # torch rebuilds a flattened optimizer state dict from the names opt.state lists (graphstep's: the step count).
    model, opt = build()
    train(model, opt, 0, 2)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    optim_sd = get_optimizer_state_dict(model, opt, options=flat)
    assert "state.0.weight.exp_avg" in optim_sd  # saving flattened works
    before = flat_format(opt)
    with pytest.raises(ValueError, match="flatten_optimizer_state_dict=True.*save and load without that option"):
        set_optimizer_state_dict(model, opt, optim_sd, options=flat)
    assert same(flat_format(opt), before)


def test_a_ranks_range_is_cut_into_boxes_that_cover_it_in_order():
    from graphstep.checkpoint.param_pieces import boxes
    gen = torch.Generator().manual_seed(0)
    for shape in [(7,), (5, 3), (4, 3, 5), (2, 3, 4, 5), (1, 9), (9, 1)]:
        numel = torch.Size(shape).numel()
        for _ in range(40):
            start, end = sorted(torch.randint(0, numel + 1, (2,), generator=gen).tolist())
            marks = torch.zeros(shape, dtype=torch.int64)
            flat = torch.arange(numel).view(shape)
            position = start
            for offsets, sizes in boxes(shape, start, end):
                assert len(offsets) == len(sizes) == len(shape)
                index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                marks[index] += 1
                piece = flat[index].reshape(-1)
                assert torch.equal(piece, torch.arange(position, position + piece.numel()))  # contiguous, in order
                position += piece.numel()
            assert position == max(start, end) if end > start else position == start
            want = torch.zeros(numel, dtype=torch.int64)
            want[start:end] = 1
            assert torch.equal(marks.reshape(-1), want), (shape, start, end)
            assert len(boxes(shape, start, end)) <= 2 * len(shape) - 1


def test_a_tensor_parallel_slices_range_lies_in_the_whole_param_where_the_slice_does():
    from graphstep.checkpoint.param_pieces import SliceOfWhole
    gen = torch.Generator().manual_seed(1)
    for whole_shape, dim, parts in [((12,), 0, 2), ((6, 5), 0, 3), ((4, 6), 1, 2), ((2, 4, 6), 2, 2), ((3, 4, 5), 1, 4)]:
        whole = torch.arange(torch.Size(whole_shape).numel()).view(whole_shape)
        for part in range(parts):
            local = whole.chunk(parts, dim)[part]
            where = SliceOfWhole(tuple(local.shape), dim, parts, part)
            assert where.global_shape == whole_shape and torch.equal(where.local_of(whole), local)
            for _ in range(20):
                start, end = sorted(torch.randint(0, local.numel() + 1, (2,), generator=gen).tolist())
                found = [whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                         for offsets, sizes in where.boxes(start, end)]
                got = torch.cat(found) if found else torch.empty(0, dtype=whole.dtype)
                assert torch.equal(got, local.reshape(-1)[start:end]), (whole_shape, dim, part, start, end)
