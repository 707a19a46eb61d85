"""``graphstep profile``: K steps of the built-in model with a range per stage and per step.

``scope="iteration"`` profiles the whole iteration instead (``graphstep.Iteration`` over ``micro_batches``
micro-batches): eager, a range "graphstep.iteration" per iteration holding one per micro-batch's forward and
backward and one around the step (its stages inside); captured, one "graphstep.iteration" range per replay.

Writes a torch.profiler Chrome trace (open it in chrome://tracing or Perfetto), brackets the steps with
cudaProfilerStart/Stop for ``nsys profile --capture-range=cudaProfilerApi`` when CUDA is present (the
stage ranges are NVTX ranges there), and prints GPU telemetry through NVML, or the one line
"no NVIDIA GPU (NVML not found)". torch's own ``USDT:`` trace lines around the profiler are dropped from
stderr (graphstep.app.quiet).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from capture.devices import is_cuda
from capture.profile import gpu_telemetry, nsys_window

import graphstep as gs
from graphstep.iteration import Iteration

from . import models
from .options import default_out_dir
from .precision import config_flags, prepare
from .quiet import drop_stderr_lines


@dataclass(frozen=True)
class ProfileSummary:
    trace: Path
    steps: int
    telemetry: str
    stage_ms: dict  # graphstep range name -> mean CPU milliseconds per step


def run_profile(*, steps: int = 10, preset: str = "tiny", capture: str = "eager", precision: str = "fp32",
                batch_size: int = 8, out_dir=None, device: str = "cpu", out=None, scope: str = "step",
                micro_batches: int = 2, model_config: Optional[models.GPTConfig] = None) -> ProfileSummary:
    """Profile ``steps`` steps after 3 unprofiled ones; the trace goes to ``out_dir`` (default: out/profile
    in a checkout, else the temp dir; see graphstep.app.options.default_out_dir). ``scope``: "step" (the loop
    calls ``opt.step()``) or "iteration" (``graphstep.Iteration``, each batch split into ``micro_batches``).
    ``model_config``: the GPT to profile, in place of ``preset``'s."""
    if scope not in ("step", "iteration"):
        raise ValueError(f"scope must be 'step' or 'iteration', got {scope!r}")
    if scope == "iteration" and (micro_batches < 1 or batch_size % micro_batches):
        raise ValueError(f"batch_size {batch_size} does not split into {micro_batches} equal micro-batches: "
                         "choose a batch size that is a multiple of micro_batches")
    out = out or sys.stdout
    device = torch.device(device)
    model_config = model_config or models.preset(preset)
    model = models.GPT(model_config).to(device)
    prepare(model, precision)  # fp8: hidden Linear weights -> fp8 params
    corpus = models.SyntheticCorpus(model_config.vocab_size)
    precision_flags = config_flags(precision, initial_loss_scale=2.0 ** 32)  # fp16: the config's default start
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, capture=capture, capture_warmup_steps=1,
                                              **precision_flags), model)
    opt.ranges.enabled = True
    iteration = Iteration(model, opt, models.gpt_loss, capture=capture) if scope == "iteration" else None

    def train_step(step: int) -> None:
        inputs, targets = corpus.batch(step, batch_size, model_config.seq_len, device)
        with opt.ranges(f"step {step}"):
            if iteration is not None:
                iteration(models.micro_batches(inputs, targets, micro_batches))
                return
            opt.scale_loss(model(inputs, targets)).backward()
            opt.step()
            opt.zero_grad()

    for step in range(3):  # warm-up (and the capture, with capture="graph") outside the window
        train_step(step)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if is_cuda(device):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    path = Path(out_dir) if out_dir is not None else default_out_dir("profile")
    path.mkdir(parents=True, exist_ok=True)
    trace = path / "trace.json"
    with drop_stderr_lines():
        with nsys_window(), torch.profiler.profile(activities=activities) as prof:
            for step in range(3, 3 + steps):
                train_step(step)
        prof.export_chrome_trace(str(trace))
    stage_ms = {e.key: e.cpu_time_total / 1e3 / steps for e in prof.key_averages() if e.key.startswith("graphstep.")}
    telemetry = gpu_telemetry().summary()
    ran = f"step ran {opt.capture_backend}" if iteration is None else \
        f"iteration ran {iteration.capture_backend}, {micro_batches} micro-batches"
    print(f"graphstep profile: {steps} steps of GPT {preset} ({precision}, capture={capture}, {ran}) on {device}",
          file=out)
    for name, ms in sorted(stage_ms.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<22} {ms:8.3f} ms/step", file=out)
    print(f"trace: {trace} (open in chrome://tracing or Perfetto)", file=out)
    print(telemetry, file=out)
    if iteration is not None:
        iteration.close()
    return ProfileSummary(trace, steps, telemetry, stage_ms)
