"""graphstep profile: a Chrome trace with the stage ranges, the NVML line, ranges that cost nothing off, and
none of torch's `USDT:` trace lines in the output."""

import json
import os

import pytest
import torch

import graphstep as gs
from capture.profile import Ranges, gpu_telemetry
from graphstep.app import models
from graphstep.app.profiling import run_profile
from graphstep.app.quiet import drop_stderr_lines
from toy import loss_fn, tiny_transformer


def test_profile_writes_a_trace_with_the_stage_names(tmp_path, capsys):
    summary = run_profile(steps=3, out_dir=str(tmp_path))
    events = json.loads(summary.trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    for stage in ("graphstep.step", "graphstep.norm", "graphstep.clip", "graphstep.update", "graphstep.loss_scale"):
        assert stage in names
    assert "step 3" in names
    printed = capsys.readouterr().out
    if not torch.cuda.is_available():
        assert "no NVIDIA GPU (NVML not found)" in printed


def test_profile_of_a_captured_step_shows_one_range_per_replay(tmp_path):
    summary = run_profile(steps=3, capture="graph", out_dir=str(tmp_path))
    names = [e.get("name") for e in json.loads(summary.trace.read_text())["traceEvents"]]
    assert names.count("graphstep.step") == 3
    assert "graphstep.update" not in names  # stages are inside the replayed graph


NARROW_GPT = models.tiny(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2, d_ff=32)


def test_profile_of_eager_iterations_shows_a_range_per_micro_batch_and_the_step(tmp_path, capsys):
    summary = run_profile(steps=2, scope="iteration", micro_batches=2, out_dir=str(tmp_path), model_config=NARROW_GPT)
    names = [e.get("name") for e in json.loads(summary.trace.read_text())["traceEvents"]]
    assert names.count("graphstep.iteration") == 2
    assert names.count("graphstep.forward") == names.count("graphstep.backward") == 2 * 2
    assert names.count("graphstep.step") == 2 and names.count("graphstep.update") == 2  # the step's stages in it
    assert "iteration ran eager" in capsys.readouterr().out


def test_profile_of_a_captured_iteration_shows_one_range_per_replay(tmp_path):
    summary = run_profile(steps=3, scope="iteration", capture="graph", out_dir=str(tmp_path), model_config=NARROW_GPT)
    names = [e.get("name") for e in json.loads(summary.trace.read_text())["traceEvents"]]
    assert names.count("graphstep.iteration") == 3
    assert not {"graphstep.forward", "graphstep.backward", "graphstep.step", "graphstep.update"} & set(names)


def test_the_profile_command_takes_the_iteration_scope(monkeypatch):
    from graphstep.app import cli, profiling

    seen = {}
    monkeypatch.setattr(profiling, "run_profile", lambda **kwargs: seen.update(kwargs))
    assert cli.main(["profile", "--scope", "iteration", "--micro-batches", "4", "--steps", "1", "--device", "cpu"]) == 0
    assert seen["scope"] == "iteration" and seen["micro_batches"] == 4
    assert cli.build_parser().parse_args(["profile"]).scope == "step"
    with pytest.raises(ValueError, match="does not split into 3 equal micro-batches"):
        run_profile(scope="iteration", batch_size=8, micro_batches=3)


def test_an_iterations_ranges_off_cost_nothing_and_an_evaluation_has_its_own():
    from _iteration_setup import gpt_with_dropout, micro_batches, optimizer
    from _iteration_setup import loss_fn as iteration_loss

    from graphstep.iteration import Iteration

    model = gpt_with_dropout()
    opt = optimizer(model, capture="graph")
    iteration = Iteration(model, opt, iteration_loss, capture="graph", warmup=1)
    batch = micro_batches(0, k=1)[0]
    with torch.profiler.profile() as prof:
        iteration(batch=batch)
    assert not [e for e in prof.events() if e.name.startswith("graphstep.")]
    opt.ranges.enabled = True
    with torch.profiler.profile() as prof:
        for _ in range(3):  # eager (the evaluation's warm-up), capture, replay
            iteration.evaluate(batch)
    names = [e.name for e in prof.events() if e.name.startswith("graphstep.")]
    assert names.count("graphstep.evaluate") == 3 and names.count("graphstep.forward") == 1


def test_nvml_reports_no_gpu_instead_of_crashing():
    telemetry = gpu_telemetry()
    if not torch.cuda.is_available():
        assert telemetry.error == "no NVIDIA GPU (NVML not found)"
        assert telemetry.summary() == telemetry.error


def test_ranges_off_are_one_shared_no_op_and_the_step_is_unchanged():
    ranges = Ranges()
    assert ranges("a") is ranges("b")  # no object per call while off
    model = tiny_transformer()
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="eager"), model)
    assert not opt.ranges.enabled
    with torch.profiler.profile() as prof:
        opt.zero_grad()
        loss_fn(model, 0).backward()
        opt.step()
    assert not [e for e in prof.events() if e.name.startswith("graphstep.")]


def test_profile_output_has_no_usdt_lines(tmp_path, capfd):
    # capfd captures file descriptors 1 and 2, where torch's C++ profiler (kineto) writes its USDT lines.
    # First, that this torch prints them around every profiler (else the check below could not fail):
    printed = []
    for _ in range(2):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            torch.ones(4).sum()
        printed.append("USDT:" in capfd.readouterr().err)
    if not any(printed):  # torch 2.11's build, for one: nothing for drop_stderr_lines to drop
        pytest.skip(f"torch {torch.__version__} prints no USDT line around a profiler")
    assert all(printed), "torch printed a USDT line around one profiler and not the next"
    run_profile(steps=1, out_dir=str(tmp_path))
    captured = capfd.readouterr()
    assert "graphstep profile: 1 steps" in captured.out
    assert "USDT" not in captured.out and "USDT" not in captured.err


def test_drop_stderr_lines_keeps_the_other_lines_in_order(capfd):
    with drop_stderr_lines(b"USDT:"):
        os.write(2, b"USDT: profiler_start\nfirst kept\n")
        os.write(2, b"second kept\nUSDT: profiler_stop\nthird kept, no newline")
    os.write(2, b"|after\n")
    assert capfd.readouterr().err == "first kept\nsecond kept\nthird kept, no newline|after\n"
