"""Hybrid CPU offload (graphstep.offload) on one process. On this CPU-only machine both sides are the CPU
and the same fused kernel runs on both, so every fraction must be bitwise equal to no offload."""

import math

import pytest
import torch
from toy import loss_fn, tiny_transformer

import graphstep as gs
from graphstep.plan.layout import ParamSpec, plan_layout
from graphstep.offload import host_buckets, plan_offload

PRECISIONS = {"fp32": {}, "bf16": {"bf16": True},
              "bf16-grads": {"bf16": True, "main_grads_dtype": torch.bfloat16},  # bf16 grads, fp32 main params
              "fp16": {"fp16": True, "initial_loss_scale": 2.0**12, "loss_scale_window": 7}}
INF_STEPS = (9, 23, 24)
FRACTIONS = (0.3, 0.5, 1.0)


def offload(fraction, **more):
    return {} if fraction is None else dict(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction, **more)


def train(fraction, rule="adam", precision="fp16", mode="eager", steps=50, model=None, **more):
    """50 steps with clipping (active: the toy's norm is ~1-3), an lr schedule, a weight-decay change and
    non-finite grads at INF_STEPS (fp16: the loss scale backs off)."""
    model = tiny_transformer() if model is None else model
    # kernel="fused" named: the module-scoped references are built outside conftest's per-test kernel pin.
    opt = gs.get_optimizer(gs.OptimizerConfig(optimizer=rule, lr=2e-3, weight_decay=0.05, clip_grad=0.5,
                                              kernel="fused", capture=mode, capture_warmup_steps=2,
                                              **PRECISIONS[precision],
                                              **offload(fraction, **more)), model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    names = [n for n, _ in model.named_parameters()]
    flags = []
    for step in range(steps):
        if step == 30:
            opt.param_groups[0]["weight_decay"] = 0.1
        opt.zero_grad()
        opt.scale_loss(loss_fn(model, step)).backward()
        if step in INF_STEPS:
            victim = dict(model.named_parameters())[names[step % len(names)]]
            victim.main_grad.view(-1)[0] = float("inf")
        flags.append(bool(opt.step().update_successful))
        sched.step()
    opt.finish_param_gather()
    return model, opt, flags


def assert_same_run(a, b):
    (model_a, opt_a, flags_a), (model_b, opt_b, flags_b) = a, b
    assert flags_a == flags_b and not all(flags_a)
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(p, q), f"param {name} differs"
    sd_a, sd_b = opt_a.state_dict(), opt_b.state_dict()
    assert torch.equal(sd_a["step"], sd_b["step"])
    for x, y in zip(sd_a["main_params"], sd_b["main_params"]):
        assert torch.equal(x.cpu(), y.cpu()), "main params differ"
    for name in sd_b["state"]:
        for x, y in zip(sd_a["state"][name], sd_b["state"][name]):
            assert torch.equal(x.cpu(), y.cpu()), f"{name} differs"
    assert sd_a["scaler"] is None or all(torch.equal(sd_a["scaler"][k], sd_b["scaler"][k]) for k in sd_b["scaler"])


# ---- the plan -------------------------------------------------------------------------------------------
def _layout(dp=1):
    shapes = [(300,), (64, 64), (7,), (128, 33), (1000,), (50, 50)]
    specs = [ParamSpec(f"p{i}", s, torch.bfloat16 if i % 3 == 2 else torch.float32, torch.float32, i % 2)
             for i, s in enumerate(shapes)]
    return plan_layout(specs, dp, bucket_size=5000)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_plan_takes_whole_pieces_from_the_end_of_the_shard_until_the_fraction(dp):
    layout = _layout(dp)
    for rank in range(dp):
        previous = -1
        for fraction in (0.0, 0.1, 0.3, 0.5, 0.9, 1.0):
            plan = plan_offload(layout, rank, fraction)
            owned = layout.owned_ranges(rank)
            biggest = max(r.param_end - r.param_start for r in owned)
            taken = plan.host_param_numel
            threshold = fraction * plan.owned_numel
            assert threshold <= taken < threshold + biggest or taken == 0 == fraction
            assert taken >= previous  # monotone in the fraction
            previous = taken
            # The host part of each buffer is a suffix of the shard holding exactly the taken pieces, whole.
            for r in owned:
                b = layout.params[r.param].buffer
                assert (r.shard_start >= plan.splits[b]) == (r in plan.host_ranges)
            if fraction == 1.0:
                assert plan.splits == (0,) * len(layout.buffers)
            if fraction == 0.0:
                assert not plan.any_host and plan.splits == plan.shard_numels


def test_host_buckets_are_the_same_on_every_rank_and_cover_every_rank_s_host_part():
    layout = _layout(2)
    touched = host_buckets(layout, 0.5)
    for rank in range(2):
        plan = plan_offload(layout, rank, 0.5)
        for r in plan.host_ranges:
            assert layout.params[r.param].bucket in touched
    assert host_buckets(layout, 0.0) == ()
    assert host_buckets(layout, 1.0) == tuple(range(len(layout.buckets)))


# ---- config ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, match", [
    (dict(optimizer_offload_fraction=0.5), "needs optimizer_cpu_offload=True"),
    (dict(overlap_cpu_optimizer_d2h_h2d=True), "needs optimizer_cpu_offload=True"),
    (dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.5), r"must lie in \[0.0, 1.0\]"),
    (dict(optimizer_cpu_offload=True, optimizer_offload_fraction=math.nan), "must be a number"),
    (dict(optimizer_cpu_offload=True, optimizer="muon"), "Adam and SGD"),
    (dict(optimizer_cpu_offload=True, qk_clip=True), "turn qk_clip off"),
    (dict(optimizer_cpu_offload=True, main_params_dtype=torch.float64), "must be torch.float32"),
    (dict(optimizer_cpu_offload=1), "must be a bool"),
    # the grads' D2H copy is inside the device step: pageable memory would put a blocking copy in a capture
    (dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5, pin_cpu_grads=False), "pageable"),
    (dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5, pin_cpu_grads=False, capture="graph"),
     "pageable"),
])
def test_config_refuses_what_offload_cannot_do(fields, match):
    with pytest.raises(ValueError, match=match):
        gs.OptimizerConfig(**fields)


def test_unpinned_host_grads_are_allowed_for_an_eager_step():
    config = gs.OptimizerConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5, pin_cpu_grads=False,
                                capture="eager")
    assert not config.pin_cpu_grads


def test_a_param_group_routed_to_another_family_is_refused_at_build():
    model = tiny_transformer()
    overrides = {gs.ParamKey(name="3.weight"): {"optimizer": "lion"}}
    with pytest.raises(ValueError, match="host update runs adam, sgd only"):
        gs.get_optimizer(gs.OptimizerConfig(**offload(0.5)), model, config_overrides=overrides)


# ---- bitwise parity with no offload -------------------------------------------------------------------
@pytest.fixture(scope="module")
def references():
    return {(rule, precision): train(None, rule, precision) for rule in ("adam", "sgd") for precision in ("fp16",)}


@pytest.mark.parametrize("rule", ["adam", "sgd"])
@pytest.mark.parametrize("fraction", (0.0,) + FRACTIONS)
def test_every_fraction_is_bitwise_equal_to_no_offload_after_50_steps(references, rule, fraction):
    got = train(fraction, rule)
    assert_same_run(got, references[(rule, "fp16")])
    host = got[1].host_tensors
    assert (sum(t.numel() for t in host.get("main_params", [])) > 0) == (fraction > 0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_half_offloaded_fp32_and_bf16_params_match_no_offload(precision):
    assert_same_run(train(0.5, "adam", precision, steps=30), train(None, "adam", precision, steps=30))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_captured_step_with_offload_is_bitwise_equal_to_eager(precision):
    captured = train(0.5, "adam", precision, mode="graph", steps=30)
    assert captured[1].captured and captured[1].capture_backend == "replay"
    assert_same_run(captured, train(0.5, "adam", precision, mode="eager", steps=30))


def test_auto_capture_runs_the_offloaded_step_like_eager():
    assert_same_run(train(0.5, "sgd", "bf16", mode="auto", steps=20), train(0.5, "sgd", "bf16", steps=20))


# ---- the overlapped host update -----------------------------------------------------------------------
def test_overlapped_host_update_matches_and_the_next_forward_waits_for_its_chunks(monkeypatch):
    from graphstep.offload import Offload

    slow = Offload.update_chunk

    def update_chunk_slowly(self, chunk, rows):  # the forward then certainly outruns the worker
        import time
        time.sleep(0.02)
        slow(self, chunk, rows)

    monkeypatch.setattr(Offload, "update_chunk", update_chunk_slowly)
    overlapped = train(1.0, "adam", "bf16", steps=15, overlap_cpu_optimizer_d2h_h2d=True)
    opt = overlapped[1]
    assert len(opt.build_record.offload.chunks) > 1
    assert opt.build_record.offload.waited_chunks > 0  # forward pre-hooks waited for chunks the worker had not finished
    monkeypatch.setattr(Offload, "update_chunk", slow)
    assert_same_run(overlapped, train(None, "adam", "bf16", steps=15))


def test_a_model_state_dict_right_after_an_overlapped_step_holds_the_stepped_params(monkeypatch):
    # torch.save(model.state_dict()) straight after opt.step() (a Trainer's save order) must not race the worker.
    from graphstep.offload import Offload

    slow = Offload.update_chunk

    def update_chunk_slowly(self, chunk, rows):
        import time
        time.sleep(0.02)
        slow(self, chunk, rows)

    monkeypatch.setattr(Offload, "update_chunk", update_chunk_slowly)
    model, opt = train(1.0, "adam", "bf16", steps=3, overlap_cpu_optimizer_d2h_h2d=True)[:2]
    loss_fn(model, 3).backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    opt.finish_param_gather()
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


# ---- state, checkpoints, debugging -------------------------------------------------------------------
def test_state_dict_moves_between_fractions_and_resumes_bitwise():
    full = train(None, "adam", "fp16", steps=30)
    first = train(0.5, "adam", "fp16", steps=12)
    sd = first[1].state_dict()
    model = first[0]
    # Resume the same model under another split of the state (fraction 0.3), then 1.0 via the sharded format.
    opt = gs.get_optimizer(gs.OptimizerConfig(optimizer="adam", lr=2e-3, weight_decay=0.05, clip_grad=0.5,
                                              capture="eager", **PRECISIONS["fp16"], **offload(0.3)), model)
    opt.load_state_dict(sd)
    reloaded = opt.state_dict()
    for x, y in zip(reloaded["main_params"], sd["main_params"]):
        assert torch.equal(x.cpu(), y.cpu())
    sharded = opt.sharded_state_dict()
    other = gs.get_optimizer(gs.OptimizerConfig(optimizer="adam", lr=2e-3, weight_decay=0.05, clip_grad=0.5,
                                                capture="eager", **PRECISIONS["fp16"], **offload(1.0)), model)
    other.load_sharded_state_dict({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sharded.items()})
    again = other.sharded_state_dict()
    for key, value in sharded.items():
        assert torch.equal(again[key].cpu(), value.cpu()), key
    # Both hold the same state as the run that never stopped had at step 12.
    half = train(None, "adam", "fp16", steps=12)[1].state_dict()
    for name in half["state"]:
        for x, y in zip(other.state_dict()["state"][name], half["state"][name]):
            assert torch.equal(x.cpu(), y.cpu())
    assert full[2]  # the uninterrupted run exists for the reader's orientation only


def test_debug_step_runs_the_host_update_as_its_last_stage_and_finds_a_nan_in_host_memory():
    model = tiny_transformer()
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="eager", **offload(1.0)), model)
    loss_fn(model, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    report = opt.debug_step()
    assert [s.name for s in report.stages][-1] == "offload_host"
    assert report.update_successful and report.nan_origin is None
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the host update landed
    opt.host_tensors["main_params"][0][5] = float("nan")  # host element 5: the first param of the shard
    opt.zero_grad()
    loss_fn(model, 1).backward()
    report = opt.debug_step()
    first = opt.layout.params[min(opt.layout.owned_ranges(0), key=lambda r: r.shard_start).param].name
    assert report.nan_origin is not None
    assert (report.nan_origin.tensor, report.nan_origin.param) == ("main_param", first)


# ---- memory -------------------------------------------------------------------------------------------
def _device_optimizer_bytes(opt) -> int:
    """Bytes of main params and state the device holds (main params that are the params count nothing)."""
    b = opt.buffers
    main = sum(m.numel() * m.element_size() for m, is_param in zip(b.main_shard, b.main_is_param) if not is_param)
    return main + sum(t.numel() * t.element_size() for ts in b.state.values() for t in ts)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_device_optimizer_bytes_drop_by_the_offloaded_fraction(precision, fraction):
    def build(f):
        return gs.get_optimizer(gs.OptimizerConfig(capture="eager", **PRECISIONS[precision], **offload(f)),
                                tiny_transformer())

    base, opt = build(None), build(fraction)
    full = _device_optimizer_bytes(base)
    per_element = full // sum(r.param_end - r.param_start for r in base.layout.owned_ranges(0)) or 1
    biggest = max(p.numel() for p in opt.buffers.params) * per_element
    padding = base.layout.padding_numel() * per_element
    kept = _device_optimizer_bytes(opt)
    assert abs(kept - (1 - fraction) * full) <= biggest + padding
    host = opt.host_tensors
    host_bytes = sum(t.numel() * t.element_size() for kind in ("main_params", "exp_avg", "exp_avg_sq")
                     for t in host[kind])
    assert kept + host_bytes >= full  # nothing lost: the host holds the rest (plus its padding)
    assert all(not t.is_pinned() for ts in host.values() for t in ts)  # a CPU-only torch pins nothing


def test_memory_stats_reports_device_and_host_bytes_apart():
    from graphstep.run import memory
    del memory
    base = gs.get_optimizer(gs.OptimizerConfig(capture="eager", bf16=True), tiny_transformer())
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="eager", bf16=True, **offload(0.5)), tiny_transformer())
    stats, ref = opt.memory_stats(), base.memory_stats()
    assert set(stats) >= {"device", "host"}
    host_total = sum(t.numel() * t.element_size() for ts in opt.host_tensors.values() for t in ts)
    assert stats["host"]["total"] == host_total > 0
    dropped = ref["device"]["total"] - stats["device"]["total"]
    expected = _device_optimizer_bytes(base) - _device_optimizer_bytes(opt)
    assert dropped == expected > 0


def test_half_grads_are_cast_to_fp32_only_for_the_device_part():
    # bf16 grads under fp32 main params: the device update reads an fp32 cast of its part of the grads; the
    # host casts its own part, so a scratch over the whole shard would hold the offloaded bytes on the device.
    half, base = train(0.5, "adam", "bf16-grads", steps=20), train(None, "adam", "bf16-grads", steps=20)
    assert_same_run(half, base)
    opt = half[1]
    on_device = sum(opt.buffers.device_numel(b) for b in range(len(opt.layout.buffers)))
    assert 0 < on_device < sum(buf.shard_numel for buf in opt.layout.buffers)
    assert opt.memory_stats()["device"]["grad_cast"] == 4 * on_device


def test_a_replaced_offloaded_param_is_adopted_into_the_host_main_params():
    def run(fraction):
        model = tiny_transformer()
        opt = gs.get_optimizer(gs.OptimizerConfig(capture="graph", capture_warmup_steps=1, bf16=True,
                                                  **offload(fraction)), model)
        for step in range(6):
            if step == 3:  # the embedding: on the host at fraction 0.3 (graphstep.offload.plan)
                with torch.no_grad():
                    model[0].weight.data = torch.full_like(model[0].weight, 0.25)
            opt.zero_grad()
            loss_fn(model, step).backward()
            opt.step()
        return model, opt

    (ref, _), (got, opt) = run(None), run(0.3)
    assert opt.recaptures == 1
    for p, q in zip(ref.parameters(), got.parameters()):
        assert torch.equal(p, q)
