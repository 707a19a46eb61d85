"""The training run behind ``graphstep demo``: the README's loop over the built-in GPT, timed, with progress.

``train(settings, capture)`` trains a fresh model (same seed, same batches every time) and returns a
``RunResult`` of host values read once at the end. The only host syncs are marked ``# host sync``: at a
progress report and after the last step. With a process group it is one data-parallel rank of the
distributed optimizer, training on its slice of each global batch.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from capture.devices import is_cuda, synchronize

import graphstep as gs
from graphstep.iteration import Iteration

from . import models
from .precision import cast_by_the_optimizer, config_flags, prepare
# Muon: 3e-3 reached a lower loss than 1e-3 on the tiny preset when Muon was added. Its other params train
# with Adam at the same lr.
DEFAULT_LR = {"adam": 1e-3, "sgd": 0.1, "muon": 3e-3}
# --moments: Megatron-Core's --exp-avg-dtype spellings (fp8 is torch.uint8 there).
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
# SGD's weight decay is an L2 term added to the grads (not scaled by lr as AdamW's is): keep it small.
DEFAULT_WEIGHT_DECAY = {"adam": 0.1, "sgd": 1e-4, "muon": 0.1}
# QK-clip's threshold for the demo: low enough that the tiny model's logits reach it (Megatron's default,
# 100, is for large models whose logits grow far beyond the tiny one's).
DEMO_QK_CLIP_THRESHOLD = 20.0


@dataclass(frozen=True)
class DemoSettings:
    """What a demo run trains; the same settings give the same batches and initial params."""
    steps: int = 200
    preset: str = "tiny"
    precision: str = "fp32"
    moments: str = "fp32"  # Adam's exp_avg / exp_avg_sq storage: fp32, or bf16/fp16/fp8 (precision-aware)
    optimizer: str = "adam"
    qk_clip: bool = False
    batch_size: int = 16  # global: split over the data-parallel ranks
    seed: int = 0
    lr: Optional[float] = None
    log_every: Optional[int] = None
    device: str = "cpu"
    timeout_s: float = 120.0  # distributed_timeout_s with --world-size > 1
    scope: str = "step"  # what is captured: "step" (opt.step()) or "iteration" (forward, backward and step)


@dataclass(frozen=True)
class Progress:
    """One progress report (host values), from the rank that prints."""
    label: str
    step: int  # 1-based: steps done
    steps: int
    loss: float  # mean over the steps since the previous report
    ms: float  # median ms/step since the previous report
    lr: float
    loss_scale: Optional[float]  # None without a loss scaler
    skipped: int = 0  # steps skipped so far (non-finite grads): the engine's StepResult.skipped_steps


@dataclass(frozen=True)
class RunResult:
    label: str  # the capture mode asked for: "eager", "graph" or "auto"
    backend: str  # what ran the optimizer step: opt.capture_backend ("eager", "replay" or the CUDA graph's)
    losses: torch.Tensor  # (steps,) fp32 on the CPU: the loss of every step (global mean with ranks)
    times_ms: list
    skipped: int  # steps skipped (non-finite grads): StepResult.skipped_steps after the last step
    loss_scale: Optional[float]  # at the end; None without a loss scaler
    params_sha256: str  # of the final params' bytes: bitwise comparison across runs and ranks
    world_size: int = 1
    params_same_on_all_ranks: bool = True

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    def final_loss(self, last: int) -> float:
        """Mean loss over the last ``last`` steps (one progress interval): less noisy than one step."""
        return float(self.losses[-last:].double().mean())


def log_interval(settings: DemoSettings) -> int:
    return settings.log_every or max(1, settings.steps // 10)


def optimizer_config(settings: DemoSettings, capture: str, distributed: bool = False) -> gs.OptimizerConfig:
    lr = settings.lr if settings.lr is not None else DEFAULT_LR[settings.optimizer]
    # fp16: Megatron's 2**32 start would skip ~30 steps backing off; the demo's grads fit 2**16.
    precision = config_flags(settings.precision, initial_loss_scale=2.0**16)
    dist_flags = ({"use_distributed_optimizer": True, "distributed_timeout_s": settings.timeout_s}
                  if distributed else {})
    qk_clip = {"qk_clip": True, "qk_clip_threshold": DEMO_QK_CLIP_THRESHOLD} if settings.qk_clip else {}
    moments = {}
    if settings.moments != "fp32":
        dtype = MOMENT_DTYPES[settings.moments]
        moments = {"use_precision_aware_optimizer": True, "exp_avg_dtype": dtype, "exp_avg_sq_dtype": dtype}
    return gs.OptimizerConfig(optimizer=settings.optimizer, lr=lr,
                              weight_decay=DEFAULT_WEIGHT_DECAY[settings.optimizer], adam_beta1=0.9,
                              adam_beta2=0.95, sgd_momentum=0.9, clip_grad=1.0, capture=capture,
                              **precision, **dist_flags, **qk_clip, **moments)


def warmup_cosine(steps: int, warmup: int, floor: float = 0.1):
    """LR multiplier: linear warm-up, then cosine down to ``floor`` of the peak (for LambdaLR)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def estimate_seconds(settings: DemoSettings, runs: int, world_size: int = 1) -> float:
    """Roughly how long ``runs`` trainings with ``settings`` take here, measured rather than guessed: a
    batch drawn plus forward and backward of this rank's slice at the run's precision, the best of the
    second and third of three passes (the first pays one-time allocations; a busy machine slows any single
    one). The optimizer step adds a few percent on the built-in presets, counted as 10%; spawning ranks (each
    imports torch) a few seconds."""
    device = torch.device(settings.device)
    model_config = models.preset(settings.preset, qk_clip=settings.qk_clip)
    model = models.GPT(model_config, seed=settings.seed).to(device)
    dtype = optimizer_config(settings, "eager").model_dtype
    if dtype is not None:
        model.to(dtype)
    prepare(model, settings.precision)  # fp8: after the cast, so the fp8 bytes and scales stay as converted
    corpus = models.SyntheticCorpus(model_config.vocab_size, seed=settings.seed)
    rows = slice(0, max(1, settings.batch_size // world_size))
    seconds = []
    for step in range(3):
        started = time.perf_counter()
        inputs, targets = corpus.batch(step, settings.batch_size, model_config.seq_len, device)
        model(inputs[rows], targets[rows]).backward()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    step_seconds = min(seconds[1:])
    startup = 5.0 if world_size > 1 else 0.0
    return runs * settings.steps * step_seconds * 1.1 + startup


class StepTimer:
    """ms per step without a host sync per step: wall clock on the CPU (its kernels run synchronously),
    CUDA events on a GPU, read only when asked."""

    def __init__(self, device: torch.device):
        self._cuda = is_cuda(device)
        self._pending: list = []
        self.times_ms: list[float] = []

    def start(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started) -> None:
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((started, end))
        else:
            self.times_ms.append((time.perf_counter() - started) * 1e3)

    def collect(self) -> list[float]:
        """All times so far; on CUDA this waits for the pending events (a host sync)."""
        if self._pending:
            self._pending[-1][1].synchronize()
            self.times_ms += [s.elapsed_time(e) for s, e in self._pending]
            self._pending = []
        return self.times_ms


def params_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def train(settings: DemoSettings, capture: str, report: Optional[Callable[[Progress], None]] = None,
          every: Optional[int] = None, rank: int = 0, world_size: int = 1) -> RunResult:
    """Train a fresh GPT with ``capture`` ("eager" | "graph" | "auto"); ``report`` gets a Progress every
    ``every`` steps (and at the first and last). With ``world_size > 1`` the default process group must be
    initialized: this rank trains on its slice of each global batch with the distributed optimizer."""
    device = torch.device(settings.device)
    model_config = models.preset(settings.preset, qk_clip=settings.qk_clip)
    model = models.GPT(model_config, seed=settings.seed).to(device)  # same seed: same params on all ranks
    prepare(model, settings.precision)  # fp8: hidden Linear weights -> fp8 params (same bytes on all ranks)
    corpus = models.SyntheticCorpus(model_config.vocab_size, seed=settings.seed)
    with cast_by_the_optimizer():
        opt = gs.get_optimizer(optimizer_config(settings, capture, world_size > 1), model)  # params -> flat buffers
    # --scope iteration: forward, backward and step in one graph (gs.Iteration), fed this rank's slice of each batch
    iteration = Iteration(model, opt, models.gpt_loss, capture=capture) if settings.scope == "iteration" else None
    warmup = max(1, min(50, settings.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(settings.steps, warmup))
    per_rank = settings.batch_size // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)  # this rank's slice of each global batch
    every = every or log_interval(settings)

    timer = StepTimer(device)
    losses = torch.zeros(settings.steps, dtype=torch.float32, device=device)  # filled on device
    result = None
    reported = 0
    for step in range(settings.steps):
        inputs, targets = corpus.batch(step, settings.batch_size, model_config.seq_len, device)
        started = timer.start()
        if iteration is None:
            loss = model(inputs[rows], targets[rows])
            opt.scale_loss(loss).backward()  # times the loss scale with fp16; the loss itself otherwise
            result = opt.step()  # device tensors only: no sync
            opt.zero_grad()  # in place
        else:
            result = iteration(batch=(inputs[rows], targets[rows]))  # device tensors only: no sync
            loss = result.loss
        sched.step()  # writes the next lr into param_groups; the engine copies it to a device tensor
        losses[step] = loss.detach()
        timer.stop(started)
        done = step + 1
        if report is not None and (step == 0 or done % every == 0 or done == settings.steps):
            mean_loss = losses[reported:done].double().mean().item()  # host sync: read the loss to print it
            scale = result.loss_scale.item() if opt.scaler is not None else None  # host sync
            skipped = int(result.skipped_steps.item())  # host sync: the engine counts skipped steps on device
            times = timer.collect()  # host sync on CUDA (waits for the timing events)
            report(Progress(capture, done, settings.steps, mean_loss, statistics.median(times[reported:done]),
                            sched.get_last_lr()[0], scale, skipped))
            reported = done

    # host sync: everything below reads results, once, after training
    losses_cpu = losses.float().cpu()
    digest, same = params_digest(model), True
    if world_size > 1:
        import torch.distributed as dist

        opt.finish_param_gather()
        digest = params_digest(model)
        global_losses = losses.clone()
        dist.all_reduce(global_losses)  # equal slices: the global batch's loss is the mean of the ranks'
        losses_cpu = (global_losses / world_size).cpu()
        digests = [None] * world_size
        dist.all_gather_object(digests, digest)
        same = all(d == digests[0] for d in digests)
    backend = opt.capture_backend if iteration is None else iteration.capture_backend
    run = RunResult(label=capture, backend=backend, losses=losses_cpu, times_ms=timer.collect(),
                    skipped=int(result.skipped_steps.item()) if result is not None else 0,
                    loss_scale=float(opt.loss_scale.item()) if opt.scaler is not None else None,
                    params_sha256=digest, world_size=world_size, params_same_on_all_ranks=same)
    if iteration is not None:
        iteration.close()
    opt.close()  # free this run's captured graph (and its pool) before the next run builds its own
    return run


class ProgressBar:
    """Renders Progress reports: one ``\\r``-rewritten bar on a terminal, plain lines otherwise (CI, pipes)."""

    WIDTH = 24

    def __init__(self, out=None, tty: Optional[bool] = None):
        self.out = out or sys.stdout
        self.tty = tty if tty is not None else bool(getattr(self.out, "isatty", lambda: False)())
        self._open = False

    def __call__(self, p: Progress) -> None:
        scale = f"  scale {p.loss_scale:g}" if p.loss_scale is not None else ""
        skipped = f"  skipped {p.skipped}" if p.skipped else ""
        stats = f"loss {p.loss:.4f}  {p.ms:6.1f} ms/step  lr {p.lr:.2e}{scale}{skipped}"
        if self.tty:
            filled = round(self.WIDTH * p.step / p.steps)
            bar = "#" * filled + "." * (self.WIDTH - filled)
            self.out.write(f"\r{p.label:>5} [{bar}] {p.step:5d}/{p.steps}  {stats}\033[K")
            self._open = p.step < p.steps
            if not self._open:
                self.out.write("\n")
        else:
            self.out.write(f"{p.label:>5} step {p.step:5d}/{p.steps}  {stats}\n")
        self.out.flush()

    def tty_every(self, steps: int, every: int) -> int:
        """How often to report: often on a terminal (the bar moves), every ``every`` steps otherwise."""
        return max(1, steps // 100) if self.tty else every
