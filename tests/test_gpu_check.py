"""perf/gpu_check.py's CPU dry run, end to end, so the GPU check cannot rot between GPU loans.

Runs exactly the command the GPU machine runs (``perf/gpu_check.sh OUT_DIR``) with ``--cpu``, as a subprocess,
and reads its JSON: every row is listed, in the order that puts correctness first, the GPU-only ones are skipped
because there is no CUDA, the ones the CPU can run passed, and the parts' time limits fit the budget.
"""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "perf"))

import gpu_check  # noqa: E402
import gpu_check_parts  # noqa: E402
import gpu_check_runner  # noqa: E402
import peer_pipelines  # noqa: E402
from graphstep.native import update_loops  # noqa: E402

# The parts in the order the check runs them: correctness first, so that a time cut falls on speed.
ORDER = ["preflight", "cuda-tests", "bitwise", "recapture", "negative-control", "memory", "pinned-thread", "nccl",
         "multi", "families", "offload", "fp8", "fsdp2", "iteration", "profile-cli", "kernels", "speed", "fold"]
# Every row; the ones that only mean something on a GPU are skipped in the dry run.
GPU_ONLY = {"pytest-tests-cuda", "replay-without-host-sync", "captured-10k-tensors-vs-flat", "flat-64M-vs-hbm-floor",
            "memory-flat-over-10-recaptures", "capture-with-pinned-memory-thread", "nccl-world1-collectives-captured",
            "graphstep-profile-capture-graph", "offload-pinned-and-memory",
            "fold-step-vs-fused-floor", "fold-backward-plus-step", "default-step-vs-torch-amp",
            "default-step-vs-adamw-fused-clip", "iteration-captured-vs-eager-time"}
CPU_RUNNABLE = {f"bitwise-{p}-{k}" for p in ("fp32", "bf16", "fp16") for k in ("fused", "compiled")} | {
    "preflight", "preflight-torch-private-api", "bitwise-negative-control", "forced-recapture", "cpu-time-per-replay",
    "kernels-per-replay-independent-of-tensor-count", "kernels-negative-control", "offload-eager-vs-captured",
    "offload-vs-device-only", "offload-overlap", "fsdp2-one-rank-captured-vs-eager",
    "fsdp2-one-rank-iteration-captured-vs-eager", "iteration-captured-vs-eager-bitwise"}
# Rows for features: they run where OptimizerConfig accepts them, else skip saying so.
FEATURE_ROWS = {"family-muon", "family-fp8", "family-offload", "family-precision-aware"}
# Two or more ranks: skipped in the default run, saying why; ``--multi`` runs them (two gloo ranks with --cpu).
MULTI = {"multi-captured-step-matches-eager", "multi-teardown-after-capture", "multi-dead-peer-bounded"}
# The compiled peers: skipped in the default run, saying why; ``--peers`` runs them.
PEERS = {"peers-default-vs-torch-compiled-clip", "peers-default-vs-torch-compiled", "peers-default-vs-heavyball-clip",
         "peers-default-vs-heavyball"}
LISTED = (*gpu_check_parts.PARTS, gpu_check_parts.PEERS)  # every part's rows, in the order the report lists them


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHON": sys.executable}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run perf/gpu_check.sh itself (the dry run is for CPU-only machines)")
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(["bash", str(ROOT / "perf" / "gpu_check.sh"), str(out), "--cpu"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=gpu_check_parts.WHOLE_S)
    summary = json.loads((out / "gpu_check.json").read_text())
    return proc, summary, out


def test_the_parts_run_in_the_pinned_order_and_their_limits_fit_the_budget():
    assert [part.name for part in gpu_check_parts.PARTS] == ORDER
    total = sum(part.limit_s for part in gpu_check_parts.PARTS)
    assert total <= gpu_check_parts.PARTS_BUDGET_S, total
    assert gpu_check_parts.PARTS_BUDGET_S + gpu_check_parts.INSTALL_LIMIT_S <= gpu_check_parts.WHOLE_S <= 8 * 60
    assert all(0 < part.estimate_s <= part.limit_s for part in gpu_check_parts.PARTS)
    assert gpu_check_parts.budget_problem() == ""


def test_the_check_refuses_to_start_when_the_limits_exceed_the_budget(tmp_path, monkeypatch, capsys):
    slow = [dataclasses.replace(part, limit_s=part.limit_s + 30) for part in gpu_check_parts.PARTS]
    assert "add up to" in gpu_check_parts.budget_problem(slow)
    monkeypatch.setattr(gpu_check, "PARTS", tuple(slow))
    assert gpu_check.main([str(tmp_path / "out"), "--cpu"]) == 2
    assert "lower a limit" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_a_part_past_its_limit_is_stopped_and_recorded_and_the_next_part_runs(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the dry run's parts are for CPU-only machines")
    # The bitwise part takes seconds on the CPU through torch.compile (dynamo's start in the worker, every
    # run); graphstep's native Adam loop, which the worker inherits this variable to turn off, is faster.
    monkeypatch.setenv(update_loops.DISABLE_VARIABLE, "0")
    stuck = dataclasses.replace(gpu_check_parts.BY_NAME["bitwise"], limit_s=1)
    seen = []
    start = time.monotonic()
    gpu_check_runner.run_parts([stuck, gpu_check_parts.BY_NAME["negative-control"]], True, start + 120, False,
                               lambda part, checks: seen.append((part, checks)))
    (first, first_checks), (second, second_checks) = seen
    assert first["exit_code"] == "timeout" and {c["status"] for c in first_checks} == {"error"}
    assert "did not finish within its 1 s limit" in first_checks[0]["detail"]
    assert [c["check"] for c in first_checks] == list(stuck.checks)
    assert second["exit_code"] == 0 and [c["status"] for c in second_checks] == ["pass"]


def test_dry_run_lists_every_row_in_order(dry_run):
    _, summary, out = dry_run
    names = [c["check"] for c in summary["checks"]]
    assert sorted(names) == sorted(GPU_ONLY | CPU_RUNNABLE | FEATURE_ROWS | MULTI | PEERS)
    assert [part.name for part in LISTED for _ in part.checks] == [c["part"] for c in summary["checks"]]
    assert names == [c for part in LISTED for c in part.checks]
    assert [p["part"] for p in summary["parts"]] == ORDER
    assert all(p["limit_s"] == gpu_check_parts.BY_NAME[p["part"]].limit_s for p in summary["parts"])
    assert summary["budget_s"] == gpu_check_parts.PARTS_BUDGET_S
    table = (out / "gpu_check.md").read_text()
    assert [name for name in names if f"| {name} |" not in table] == []


def test_dry_run_prints_one_line_per_row_and_each_parts_expected_time(dry_run):
    proc, summary, _ = dry_run
    lines = proc.stdout.splitlines()
    for row in summary["checks"]:
        assert sum(f" {row['check']}:" in line for line in lines) == 1, row["check"]
    for part in gpu_check_parts.PARTS:
        assert any(line.startswith(f"[{part.name}]") and f"expected ~{part.estimate_s} s" in line for line in lines)


def test_the_preflight_names_the_versions_and_the_private_torch_names_it_checked(dry_run):
    _, summary, _ = dry_run
    by_name = {c["check"]: c for c in summary["checks"]}
    facts = by_name["preflight"]["numbers"]
    assert facts["torch"] == torch.__version__ and {"python", "triton", "driver", "cuda_build"} <= set(facts)
    private = by_name["preflight-torch-private-api"]
    assert private["status"] == "pass" and private["numbers"]["missing"] == []
    assert "torch.ops._c10d_functional.reduce_scatter_tensor_out" in private["numbers"]["names"]
    assert summary["install"]["status"].startswith(("pass", "skipped"))


def test_speed_goals_state_the_bytes_they_are_derived_from(dry_run):
    # A goal beyond what the bytes allow would fail by construction on a bandwidth-bound GPU: each speed row
    # names the bytes per param on both sides (the dry run reports them for reference).
    _, summary, _ = dry_run
    by_name = {c["check"]: c["detail"] for c in summary["checks"]}
    for name in ("fold-step-vs-fused-floor", "default-step-vs-torch-amp", "default-step-vs-adamw-fused-clip"):
        assert by_name[name].count("B/param") >= 2 and "goal" in by_name[name], (name, by_name[name])
    assert "same bytes" in by_name["captured-10k-tensors-vs-flat"]


def test_gpu_rows_are_skipped_for_want_of_cuda(dry_run):
    _, summary, _ = dry_run
    by_name = {c["check"]: c for c in summary["checks"]}
    assert {name: by_name[name]["status"] for name in GPU_ONLY} == {name: "skipped: no CUDA" for name in GPU_ONLY}
    assert {by_name[name]["status"] for name in MULTI} == {"skipped: multi-rank rows run with --multi (2 gloo ranks)"}
    assert {by_name[name]["status"] for name in PEERS} == {"skipped: the compiled peers run with --peers"}


def test_cpu_runnable_rows_pass_and_the_run_exits_zero(dry_run):
    proc, summary, _ = dry_run
    by_name = {c["check"]: c for c in summary["checks"]}
    failed = {n: (by_name[n]["status"], by_name[n]["detail"]) for n in CPU_RUNNABLE if by_name[n]["status"] != "pass"}
    assert not failed
    for name in FEATURE_ROWS:  # a feature the config accepts must pass; one it rejects is skipped with why
        status = by_name[name]["status"]
        assert status == "pass" or status.startswith("skipped: OptimizerConfig does not accept"), (name, status)
    # the memory row's recapture count runs on the CPU too: a wrong count fails there, not only on a GPU
    assert by_name["memory-flat-over-10-recaptures"]["numbers"]["recaptures"] == list(range(1, 11))
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert all(p["exit_code"] == 0 for p in summary["parts"])


def _run_alone(tmp_path, flag: str) -> tuple:
    """``perf/gpu_check.sh OUT --cpu FLAG``, a run of its own (``--multi``, ``--peers``): the process, the summary,
    and its rows by name."""
    if torch.cuda.is_available():
        pytest.skip(f"a GPU is present: run perf/gpu_check.sh {flag} itself")
    proc = subprocess.run(["bash", str(ROOT / "perf" / "gpu_check.sh"), str(tmp_path), "--cpu", flag], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=300)
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    return proc, summary, {c["check"]: c for c in summary["checks"]}


def _chosen(by_name: dict) -> set:
    """The rows of the parts the run chose, and of those it left out with a reason of their own."""
    return {name for name, c in by_name.items() if c["status"] != "skipped: not chosen"}


@pytest.mark.distributed  # two gloo ranks, spawned by the script with one deadline
def test_the_multi_rank_part_runs_on_two_cpu_ranks(tmp_path):
    # On a machine with one GPU the rows are skipped; with --cpu the same scenarios run on two gloo ranks,
    # so what a >= 2-GPU machine will run is exercised here: captured vs eager, teardown, a dead peer.
    proc, summary, by_name = _run_alone(tmp_path, "--multi")
    assert _chosen(by_name) == {"preflight", "preflight-torch-private-api"} | MULTI | PEERS
    assert {by_name[name]["status"] for name in PEERS} == {"skipped: the compiled peers run with --peers"}
    assert {name: by_name[name]["status"] for name in MULTI} == {name: "pass" for name in MULTI}, by_name
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_the_peers_part_runs_in_its_own_invocation(tmp_path):
    # The compiled peers (their compiles take minutes on a GPU) run only with --peers; on the CPU at a two-layer
    # GPT-2 shape, every row compiled and timed, recorded for reference.
    proc, summary, by_name = _run_alone(tmp_path, "--peers")
    assert _chosen(by_name) == {"preflight", "preflight-torch-private-api"} | PEERS | MULTI
    assert {by_name[name]["status"] for name in MULTI} == {"skipped: multi-rank rows run with --multi"}
    for name in ("peers-default-vs-torch-compiled-clip", "peers-default-vs-torch-compiled"):
        row = by_name[name]
        assert row["status"] == "skipped: no CUDA" and row["detail"].startswith("CPU for reference: "), row
        assert row["numbers"]["peer_ms"] > 0 and row["numbers"]["graphstep_ms"] > 0
    problem = peer_pipelines.heavyball_problem()  # heavyball is not a dependency: where it is missing, say so
    expected = "skipped: no CUDA" if problem is None else "skipped: RuntimeError: " + problem
    assert {by_name[name]["status"] for name in ("peers-default-vs-heavyball-clip", "peers-default-vs-heavyball")} == {
        expected}
    assert summary["budget_s"] == gpu_check_parts.PEERS_LIMIT_S + gpu_check_parts.BY_NAME["preflight"].limit_s
    assert proc.returncode == 0, proc.stdout[-2000:]
