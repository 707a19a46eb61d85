"""perf/gpu_check.py's CPU dry run, end to end, so the GPU check cannot rot between GPU loans.

Runs it as a subprocess (perf/ is never imported by the tests) and reads its JSON: every check is listed,
the GPU-only ones are skipped because there is no CUDA, and the ones the CPU can run passed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# Every check the script owns; the ones that only mean something on a GPU are skipped in the dry run.
GPU_ONLY = {"pytest-tests-cuda", "replay-without-host-sync", "captured-10k-tensors-vs-flat", "flat-64M-vs-hbm-floor",
            "memory-flat-over-10-recaptures", "capture-with-pinned-memory-thread", "nccl-world1-collectives-captured",
            "graphstep-profile-capture-graph", "offload-pinned-and-memory",
            "fold-step-vs-fused-floor", "fold-backward-plus-step", "default-step-vs-torch-amp",
            "default-step-vs-adamw-fused-clip"}
CPU_RUNNABLE = {f"bitwise-{p}-{k}" for p in ("fp32", "bf16", "fp16") for k in ("fused", "compiled")} | {
    "preflight", "bitwise-negative-control", "forced-recapture", "cpu-time-per-replay",
    "kernels-per-replay-independent-of-tensor-count", "offload-eager-vs-captured", "offload-vs-device-only",
    "offload-overlap"}
# Rows for features later issues add: they run where OptimizerConfig accepts them, else skip saying so.
FEATURE_ROWS = {"family-muon", "family-fp8", "family-offload", "family-precision-aware"}
# Two or more ranks: listed as skipped in the default run; ``--multi`` runs them (two gloo ranks with --cpu).
MULTI = {"multi-captured-step-matches-eager", "multi-teardown-after-capture", "multi-dead-peer-bounded"}
BUDGET_S = 470  # perf/gpu_check.py's BUDGET_S: the dry run must finish well inside it


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run perf/gpu_check.py itself (the dry run is for CPU-only machines)")
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "perf" / "gpu_check.py"), str(out), "--cpu", "--no-install"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = json.loads((out / "gpu_check.json").read_text())
    return proc, summary, out


def test_dry_run_lists_every_check(dry_run):
    _, summary, out = dry_run
    names = [c["check"] for c in summary["checks"]]
    assert sorted(names) == sorted(GPU_ONLY | CPU_RUNNABLE | FEATURE_ROWS | MULTI)
    assert names[:2] == ["preflight", "pytest-tests-cuda"]  # correctness first: a budget cut falls on speed
    assert summary["budget_s"] == BUDGET_S and summary["wall_s"] < BUDGET_S / 2, summary["wall_s"]
    table = (out / "gpu_check.md").read_text()
    assert [name for name in names if f"| {name} |" not in table] == []


def test_speed_goals_state_the_bytes_they_are_derived_from(dry_run):
    # A goal beyond what the bytes allow would fail by construction on a bandwidth-bound GPU: each speed row
    # names the bytes per param on both sides (the dry run reports them for reference).
    _, summary, _ = dry_run
    by_name = {c["check"]: c["detail"] for c in summary["checks"]}
    for name in ("fold-step-vs-fused-floor", "default-step-vs-torch-amp", "default-step-vs-adamw-fused-clip"):
        assert by_name[name].count("B/param") >= 2 and "goal" in by_name[name], (name, by_name[name])
    assert "same bytes" in by_name["captured-10k-tensors-vs-flat"]


def test_gpu_checks_are_skipped_for_want_of_cuda(dry_run):
    _, summary, _ = dry_run
    by_name = {c["check"]: c for c in summary["checks"]}
    assert {name: by_name[name]["status"] for name in GPU_ONLY} == {name: "skipped: no CUDA" for name in GPU_ONLY}


def test_cpu_runnable_checks_pass_and_the_run_exits_zero(dry_run):
    proc, summary, _ = dry_run
    by_name = {c["check"]: c for c in summary["checks"]}
    failed = {n: (by_name[n]["status"], by_name[n]["detail"]) for n in CPU_RUNNABLE if by_name[n]["status"] != "pass"}
    assert not failed
    for name in FEATURE_ROWS:  # a feature the config accepts must pass; one it rejects is skipped with why
        status = by_name[name]["status"]
        assert status == "pass" or status.startswith("skipped: OptimizerConfig does not accept"), (name, status)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(p["exit_code"] in (0, None) for p in summary["parts"])


@pytest.mark.distributed  # two gloo ranks, spawned by the script with one deadline
def test_the_multi_rank_part_runs_on_two_cpu_ranks(tmp_path):
    # On a machine with one GPU the part is skipped; with --cpu the same scenarios run on two gloo ranks,
    # so what a >= 2-GPU machine will run is exercised here: captured vs eager, teardown, a dead peer.
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run perf/gpu_check.py --multi itself")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(ROOT / "perf" / "gpu_check.py"), str(tmp_path), "--cpu", "--no-install",
                           "--multi"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    by_name = {c["check"]: (c["status"], c["detail"]) for c in summary["checks"]}
    assert set(by_name) == {"preflight"} | MULTI
    assert {name: by_name[name][0] for name in MULTI} == {name: "pass" for name in MULTI}, by_name
    assert proc.returncode == 0, proc.stderr[-2000:]
