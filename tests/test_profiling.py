"""graphstep profile: a Chrome trace with the stage ranges, the NVML line, and ranges that cost nothing off."""

import json

import torch

import graphstep as gs
from capture.profile import Ranges, gpu_telemetry
from graphstep.profiling import run_profile
from toy import loss_fn, tiny_transformer


def test_profile_writes_a_trace_with_the_stage_names(tmp_path, capsys):
    summary = run_profile(steps=3, out_dir=str(tmp_path))
    events = json.loads(summary.trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    for stage in ("graphstep.step", "graphstep.unscale", "graphstep.clip", "graphstep.update", "graphstep.scale"):
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
