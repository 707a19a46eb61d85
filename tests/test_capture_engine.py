"""The engine captured (CPU replay backend) against the engine eager: bitwise, with everything moving."""

import logging

import pytest
import torch
from _dispatched import DispatchedOps
from toy import loss_fn, tiny_transformer

import capture
import graphstep as gs
import graphstep.run.runner as runner_mod
from graphstep.step import compiled_scalar_math

# The capture tests run the default kernel (kernel="auto": "compiled" here), as users do: a capture that would
# compile, or a variant first needed at a recapture, fails here as it would on a GPU. Tests of the fused
# kernel's own behaviour pass kernel="fused".
pytestmark = pytest.mark.auto_as_large

PRECISIONS = {"fp32": {}, "bf16": {"bf16": True}, "fp16": {"fp16": True, "initial_loss_scale": 2.0**12,
                                                           "loss_scale_window": 7}}
INF_STEPS = {13, 14, 40, 77}


def run(mode, rule, precision, steps=100, kernel="fused"):
    model = tiny_transformer()
    opt = gs.get_optimizer(gs.OptimizerConfig(optimizer=rule, lr=2e-3, weight_decay=0.05, clip_grad=0.5,
                                              capture=mode, capture_warmup_steps=2, kernel=kernel,
                                              **PRECISIONS[precision]), model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))  # lr changes every step
    names = [n for n, _ in model.named_parameters()]
    flags = []
    for step in range(steps):
        if step % 10 == 0:  # a weight-decay schedule: changes every 10 steps
            opt.param_groups[0]["weight_decay"] = 0.05 * (1 + step // 10)
        opt.zero_grad()
        opt.scale_loss(loss_fn(model, step)).backward()
        if step in INF_STEPS:
            victim = dict(model.named_parameters())[names[step % len(names)]]
            victim.main_grad.view(-1)[0] = float("inf") if step % 2 else float("nan")
        result = opt.step()
        flags.append(bool(result.update_successful))
        sched.step()
    return model, opt, flags


@pytest.mark.parametrize("rule", ["adam", "sgd"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_replay_is_bitwise_equal_to_eager_over_100_steps(rule, precision):
    eager_model, eager_opt, eager_flags = run("eager", rule, precision)
    graph_model, graph_opt, graph_flags = run("graph", rule, precision)
    assert graph_opt.captured and graph_opt.capture_backend == "replay"
    assert not eager_opt.captured
    assert eager_flags == graph_flags and not all(eager_flags)
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(a, b)
    for name in eager_opt.buffers.state:
        for a, b in zip(eager_opt.buffers.state[name], graph_opt.buffers.state[name]):
            assert torch.equal(a, b)
    for a, b in zip(eager_opt.buffers.main_shard, graph_opt.buffers.main_shard):
        assert torch.equal(a, b)
    assert torch.equal(eager_opt.loss_scale, graph_opt.loss_scale)
    assert torch.equal(eager_opt.tensors.step, graph_opt.tensors.step)
    # The fused kernel bakes weight decay: its schedule made the step recapture, never freeze.
    assert graph_opt.recaptures == 9


def test_reference_kernel_keeps_every_hyperparameter_live_without_recapture():
    eager_model, _, _ = run("eager", "adam", "fp32", steps=30, kernel="reference")
    graph_model, graph_opt, _ = run("graph", "adam", "fp32", steps=30, kernel="reference")
    assert graph_opt.recaptures == 0
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_compiled_kernel_replays_bitwise_and_never_recaptures(precision):
    # Its hyperparameters are all device tensors: the weight-decay schedule reaches the replay as is.
    eager_model, _, eager_flags = run("eager", "adam", precision, steps=30, kernel="compiled")
    graph_model, graph_opt, graph_flags = run("graph", "adam", precision, steps=30, kernel="compiled")
    assert graph_opt.captured and graph_opt.recaptures == 0
    assert eager_flags == graph_flags and not all(eager_flags)
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(a, b)


def test_compiled_scalar_math_replays_bitwise_and_equals_the_eager_ops(monkeypatch):
    # On a GPU the compiled kernel's step also compiles its scalar math (graphstep/step/compiled_scalar_math.py); forced
    # here on the CPU: fp16's dynamic loss scale, clipping and the inf steps run through the compiled graphs,
    # captured and eager, and land bitwise where the step with the same math run op by op lands.
    plain_model, _, plain_flags = run("eager", "adam", "fp16", steps=30, kernel="compiled")
    monkeypatch.setattr(compiled_scalar_math, "wanted", lambda kernel, device: kernel == "compiled")
    eager_model, eager_opt, eager_flags = run("eager", "adam", "fp16", steps=30, kernel="compiled")
    graph_model, graph_opt, graph_flags = run("graph", "adam", "fp16", steps=30, kernel="compiled")
    assert graph_opt.captured and graph_opt.recaptures == 0
    assert plain_flags == eager_flags == graph_flags and not all(eager_flags)
    for a, b, c in zip(plain_model.parameters(), eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(a, b) and torch.equal(b, c)
    assert torch.equal(eager_opt.loss_scale, graph_opt.loss_scale)
    with DispatchedOps() as ops:  # the norm's result, the clip and the loss-scale rule: a graph each
        eager_opt.step()
    assert ops.names.count("graphstep.scalar_graph_.default") == 3


def test_a_python_float_lr_read_at_capture_freezes_and_graphsteps_lr_does_not():
    # A hand-written step that reads lr as a Python float: replay keeps the value it was captured with.
    param = torch.zeros(4)
    grad = torch.ones(4)
    holder = {"lr": 1.0}
    frozen = capture.graph(lambda: param.sub_(grad * holder["lr"]), warmup=1, backend="replay")
    frozen()
    frozen()  # captured with lr = 1
    holder["lr"] = 0.0
    frozen()
    assert torch.equal(param, torch.full((4,), -3.0))  # still moved: lr 0 never reached the replay

    # graphstep's captured step: lr set to 0 after capture stops the params.
    model = tiny_transformer()
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="graph", capture_warmup_steps=1, clip_grad=0.0), model)
    for step in range(3):
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()
    assert opt.captured
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss_fn(model, 3).backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.recaptures == 0  # lr is a device tensor: no recapture needed


def captured_engine(**config):
    model = tiny_transformer()
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="graph", capture_warmup_steps=1, **config), model)
    for step in range(3):
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()
    assert opt.captured
    return model, opt


def test_a_replaced_param_is_detected_and_adopted_before_the_next_replay():
    model, opt = captured_engine()
    weight = model[3].weight
    new_values = torch.randn_like(weight)
    weight.data = new_values.clone()  # the user replaces a param's tensor after capture
    opt.zero_grad()
    loss_fn(model, 3).backward()
    opt.step()
    assert opt.recaptures == 1
    flat = opt.buffers.param_flat[0]
    assert flat.data_ptr() <= weight.data_ptr() < flat.data_ptr() + flat.numel() * flat.element_size()
    assert not torch.equal(weight.detach(), new_values)  # adopted, then updated by the step from new values


def test_a_replaced_param_raises_when_asked_to():
    model, opt = captured_engine(capture_invalidation="raise")
    model[3].weight.data = torch.randn_like(model[3].weight)
    with pytest.raises(capture.StaleInputError, match="param"):
        opt.step()


def test_state_replaced_by_assignment_is_copied_back():
    model, opt = captured_engine()
    saved = [t.clone() + 1.0 for t in opt.buffers.state["exp_avg"]]
    original = opt.buffers.state["exp_avg"][0]
    opt.buffers.state["exp_avg"][0] = saved[0]  # a checkpoint "loaded" by replacing the tensor
    opt.step()
    assert opt.buffers.state["exp_avg"][0] is original
    assert opt.recaptures == 1


def test_auto_warms_the_capture_up_once_after_the_check_before_capturing(monkeypatch):
    # capture="auto" where graphs exist (here: the replay backend standing in for CUDA): the checked step,
    # then one eager step where the capture will run (a CUDA side stream's lazy setup), then the capture.
    monkeypatch.setattr(runner_mod, "backend_for", lambda device, mode: ("replay", None))
    calls = []
    runner = runner_mod.StepRunner(step_fn=lambda: calls.append(1), device="cpu", mode="auto", warmup_steps=1,
                                   invalidation="recapture", static_inputs=dict, baked_values=tuple)
    captured_after = []
    for _ in range(5):
        runner.run()
        captured_after.append(runner.captured)
    assert captured_after == [False, False, False, True, True]  # warm-up, check, side-stream warm-up, capture
    assert len(calls) == 4  # the replay runs no Python


def test_auto_stays_eager_on_every_rank_when_another_ranks_check_found_something(monkeypatch, caplog):
    monkeypatch.setattr(runner_mod, "backend_for", lambda device, mode: ("replay", None))
    flags = []

    def agree(flag):  # the other rank's capture.check found something: the OR over the ranks is True
        flags.append(flag)
        return True

    runner = runner_mod.StepRunner(step_fn=lambda: None, device="cpu", mode="auto", warmup_steps=1,
                                   invalidation="recapture", static_inputs=dict, baked_values=tuple, agree=agree)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        for _ in range(4):
            runner.run()
    assert not runner.captured and runner.backend == "eager"
    assert flags == [False]  # this rank's check found nothing; asked once, at the check
    assert any("another rank's step is not capturable" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("capture_runs_ops", [False, True])
def test_auto_gives_capture_up_after_a_failed_capture_instead_of_retrying_every_step(monkeypatch, caplog,
                                                                                     capture_runs_ops):
    # The capture call fails (e.g. a CUDA error inside it). A CUDA capture only records, so the step is run
    # eagerly at once; a backend that ran part of it while recording cannot run it again and raises. Either
    # way later steps are eager, and the capture is never tried again.
    from capture.backends.replay import ReplayBackend

    monkeypatch.setattr(runner_mod, "backend_for", lambda device, mode: ("replay", None))
    monkeypatch.setattr(ReplayBackend, "capture_runs_ops", capture_runs_ops)
    applied, recording = [], []

    def failing_capture(self, fn):
        recording.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(ReplayBackend, "capture", failing_capture)
    runner = runner_mod.StepRunner(step_fn=lambda: applied.append(1), device="cpu", mode="auto", warmup_steps=1,
                                   invalidation="recapture", static_inputs=dict, baked_values=tuple)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        for step in range(6):
            if step == 3 and capture_runs_ops:
                with pytest.raises(RuntimeError, match="illegal memory access"):
                    runner.run()
            else:
                runner.run()
    assert recording == [1]  # tried once
    assert runner.backend == "eager" and not runner.captured
    # warm-up, check, side-stream warm-up, (the failed capture: run eagerly unless it ran part of it), 2 more
    assert len(applied) == (5 if capture_runs_ops else 6)
    assert any("could not capture the step" in r.getMessage() for r in caplog.records)


def test_auto_runs_eagerly_on_cpu_and_says_why_once(caplog):
    model = tiny_transformer()
    with caplog.at_level(logging.INFO, logger="graphstep"):
        opt = gs.get_optimizer(gs.OptimizerConfig(capture="auto"), model)
        for step in range(5):
            opt.zero_grad()
            loss_fn(model, step).backward()
            opt.step()
    assert not opt.captured and opt.capture_backend == "eager"
    messages = [r.getMessage() for r in caplog.records if "capture='auto'" in r.getMessage()]
    assert len(messages) == 1 and "CUDA graphs need a GPU" in messages[0]


def test_a_betas_schedule_every_step_recaptures_with_a_warning():
    model = tiny_transformer()
    # the fused kernel takes beta1 as a Python float (the compiled one reads it live and never recaptures)
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="graph", capture_warmup_steps=1, kernel="fused"), model)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=20)  # cycles beta1 every step
    with pytest.warns(RuntimeWarning, match="recaptured on each of the last"):
        for step in range(8):
            opt.zero_grad()
            loss_fn(model, step).backward()
            opt.step()
            sched.step()


def test_params_replaced_every_step_recapture_with_a_warning_that_names_the_replacement():
    # The streak warning used to blame a baked hyperparameter whatever made the step stale.
    model = tiny_transformer()
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="graph", capture_warmup_steps=1, kernel="fused"), model)
    with pytest.warns(RuntimeWarning, match="replaced after capture: param '0.weight'.*static inputs change every"):
        for step in range(12):
            opt.zero_grad()
            loss_fn(model, step).backward()
            model[0].weight.data = model[0].weight.detach().clone()  # a new tensor, not a write into the old one
            opt.step()
    assert opt.recaptures >= 3


def test_debug_step_reports_stages_and_the_origin_of_a_nan():
    model = tiny_transformer()
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="eager"), model)
    opt.zero_grad()
    loss_fn(model, 0).backward()
    report = opt.debug_step()
    assert [s.name for s in report.stages] == [s.name for s in opt.stages]
    assert report.update_successful and report.nan_origin is None
    assert report.stages[0].scalars["grad_norm"] > 0
    assert "norm" in report.table()

    opt.zero_grad()
    loss_fn(model, 1).backward()
    victim = model[1].linear1.weight
    victim.main_grad[0, 0] = float("nan")
    report = opt.debug_step()
    assert not report.update_successful
    assert (report.nan_origin.stage, report.nan_origin.param, report.nan_origin.tensor) == \
        ("backward", "1.linear1.weight", "grad")


def test_debug_step_names_the_stage_that_first_made_a_nan():
    # A negative second moment in one param, which no step writes: Adam's update takes its square root (NaN).
    model = tiny_transformer()
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="eager", kernel="reference", clip_grad=0.0), model)
    place = next(p for p in opt.layout.params if p.name == "0.weight")
    owned = next(o for o in opt.layout.owned_ranges(0) if o.param == place.index)
    opt.buffers.state["exp_avg_sq"][place.buffer][owned.shard_start:owned.shard_start + 4].fill_(-1.0)
    opt.zero_grad()
    loss_fn(model, 0).backward()
    model[0].weight.main_grad.zero_()
    report = opt.debug_step()
    assert report.nan_origin is not None
    assert (report.nan_origin.stage, report.nan_origin.param) == ("update", "0.weight")


def clip_toggle_run(mode, schedule):
    """15 steps whose clip threshold follows ``schedule(step)`` (0 turns clipping off)."""
    model = tiny_transformer()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-2, clip_grad=0.0, capture=mode, capture_warmup_steps=1),
                           model)
    for step in range(15):
        opt.clip_grad = schedule(step)
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()
    return model, opt


# kernel="auto" (the module runs the default kernel): compiled here, so each recapture's new variant must be warmed up
def test_turning_clipping_on_and_off_after_capture_recaptures_and_clips():
    # Unclipped and unscaled, the kernel is not given the grad scale (it would rewrite the grads): a
    # capture bakes that choice in, so turning the live clip threshold on must recapture, not freeze it.
    def schedule(step):
        return 1e-3 if 5 <= step < 10 else 0.0

    torch._dynamo.reset()  # nothing compiled yet: the captured run meets each variant first
    graph_model, graph_opt = clip_toggle_run("graph", schedule)
    eager_model, _ = clip_toggle_run("eager", schedule)
    never_model, _ = clip_toggle_run("eager", lambda step: 0.0)
    assert graph_opt.captured and graph_opt.recaptures == 2
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(eager_model.parameters(), never_model.parameters()))
