"""perf/gpu_check.py's environment parts: preflight facts, the CUDA test suite and the profile CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from capture.devices import is_cuda
from gpu_check_numerics import NO_CUDA, record

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING",
            "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_GRAPH_REGISTER", "NCCL_DEBUG")


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _mig_mode() -> str:
    """MIG mode of GPU 0 through NVML ("enabled", "disabled", or why it could not be read)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        return "enabled" if current == pynvml.NVML_DEVICE_MIG_ENABLE else "disabled"
    except Exception as error:  # no NVML, no GPU, or a GPU without MIG support
        return f"unknown ({type(error).__name__}: {str(error)[:80]})"


def _compile_problems(device) -> dict:
    """Every compile the step's first call would do, done now with the options the engine uses: the compiled
    Adam with the step's hyperparameter dtype (kernel="auto"'s probe) and a scalar graph. {what: problem}."""
    from graphstep.kernels import auto, compiled
    from graphstep.state.hyperparams import scalar_dtype
    from graphstep.step import scalar_graph

    problems = {}
    missing = compiled.missing_compile_options(compiled.COMPILE_OPTIONS)
    works, why_not, _ = auto.probe_compiled(device, scalar_dtype(device))
    if missing or not works:
        problems["compiled update"] = f"inductor has no option {', '.join(missing)}" if missing else why_not
    problem = scalar_graph.compile_problem(device)
    if problem is not None:
        problems["scalar graph"] = problem
    return problems


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception as error:  # no Triton (the CPU build) or a broken install
        return f"unavailable ({type(error).__name__})"


def part_preflight(device, small: bool) -> list[dict]:
    """What this run ran on (versions, the device, MIG, the allocator and NCCL settings in force), and
    whether everything the step compiles compiles here."""
    facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
             "triton": _triton_version(),
             "git_commit": _git_commit(), "cuda_available": torch.cuda.is_available(),
             "settings": {k: os.environ[k] for k in SETTINGS if k in os.environ}}
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        facts.update(device=f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor})",
                     devices=torch.cuda.device_count(), mig_mode=_mig_mode(),
                     allocator_backend=torch.cuda.get_allocator_backend())
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as error:
            facts["nccl"] = f"unavailable ({type(error).__name__})"
        smi = shutil.which("nvidia-smi")
        if smi:
            facts["nvidia_smi"] = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,mig.mode.current",
                                                  "--format=csv,noheader"], capture_output=True, text=True,
                                                 timeout=20).stdout.strip()
    else:
        facts["device"] = f"cpu ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    problems = _compile_problems(device)
    facts["compile_problems"] = problems
    detail = (f"torch {facts['torch']}, CUDA {facts['cuda_build']}, NCCL {facts.get('nccl', '—')}, Triton "
              f"{facts['triton']}, {facts['device']}; compiles: "
              + ("; ".join(f"{what}: {why}" for what, why in problems.items()) or "the update and a scalar graph"))
    return [record("preflight", "fail" if problems else "pass", detail, **facts)]


def part_cuda_tests(device, small: bool) -> list[dict]:
    """The CUDA-only tests (tests/cuda), pass/fail by pytest's exit code."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/cuda"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=230)
    last = proc.stdout.strip().splitlines()[-1:] or ["no output"]
    return [record("pytest-tests-cuda", "pass" if proc.returncode == 0 else "fail",
                   f"exit {proc.returncode}: {last[0]}", exit_code=proc.returncode,
                   output_tail=proc.stdout.strip().splitlines()[-25:])]


def profile_command() -> list[str]:
    """``graphstep profile``: the app's module where the CLI has moved to graphstep/app/cli.py, else the
    installed console script, else ``python -m graphstep``."""
    if importlib.util.find_spec("graphstep.app.cli") is not None:
        return [sys.executable, "-m", "graphstep.app.cli", "profile"]
    script = shutil.which("graphstep")
    return [script, "profile"] if script else [sys.executable, "-m", "graphstep", "profile"]


def part_profile_cli(device, small: bool) -> list[dict]:
    """``graphstep profile --capture graph`` on the GPU: the trace holds kernel events and the output
    carries NVML telemetry."""
    name = "graphstep-profile-capture-graph"
    if not is_cuda(device):
        return [record(name, NO_CUDA)]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = profile_command() + ["--capture", "graph", "--steps", "5", "--device", str(device), "--out", tmp]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
        trace = Path(tmp) / "trace.json"
        events = json.loads(trace.read_text()).get("traceEvents", []) if trace.exists() else []
    kernels = sum(1 for e in events if str(e.get("cat", "")).lower() == "kernel")
    telemetry = any(line.startswith("GPU ") for line in proc.stdout.splitlines())
    problems = [p for p, bad in ((f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1][:200]}",
                                  proc.returncode != 0),
                                 ("no kernel events in trace.json", kernels == 0),
                                 ("no NVML telemetry line in the output", not telemetry)) if bad]
    detail = "; ".join(problems) or f"{kernels} kernel events over 5 replayed steps; telemetry printed"
    return [record(name, "fail" if problems else "pass", detail, command=" ".join(cmd[1:]), kernel_events=kernels,
                   stdout_tail=proc.stdout.strip().splitlines()[-6:])]
