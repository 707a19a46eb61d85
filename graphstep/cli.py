"""``graphstep`` on the command line: one function per subcommand.

    graphstep demo  [--steps 300] [--preset tiny] [--precision fp32|bf16|fp16] [--capture auto|graph|eager]
                    [--optimizer adam|sgd] [--batch-size 16] [--seed 0] [--lr ...] [--log-every ...]
    graphstep bench [flags of perf/bench_step.py]     (from a checkout: perf/ is not installed)

``demo`` trains the built-in GPT (graphstep.models) on its synthetic corpus with the engine and prints
the loss and ms/step as it goes, then a summary. Its loop is the README's: the only host syncs are the
ones marked ``# host sync`` below, every ``--log-every`` steps and at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import models

PRECISIONS = ("fp32", "bf16", "fp16")
DEFAULT_LR = {"adam": 1e-3, "sgd": 0.1}
# SGD's weight decay is an L2 term added to the grads (not scaled by lr as AdamW's is): keep it small.
DEFAULT_WEIGHT_DECAY = {"adam": 0.1, "sgd": 1e-4}


# ---- demo ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoSummary:
    steps: int
    first_loss: float
    final_loss: float  # mean over the last logging interval
    loss_floor: float  # the corpus's entropy rate: the best loss a model can reach
    median_ms: float
    skipped: int
    backend: str  # what ran the optimizer step: "eager", "replay" or "cuda"


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=_positive_int, default=300, help="training steps (default 300)")
    parser.add_argument("--preset", choices=sorted(models.PRESETS), default="tiny", help="model size (default tiny)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="model params: fp32, or bf16/fp16 with fp32 main params (fp16 adds dynamic loss "
                             "scaling); default fp32")
    parser.add_argument("--capture", choices=("auto", "graph", "eager"), default="auto",
                        help="how the optimizer step runs (OptimizerConfig.capture); default auto")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="default adam")
    parser.add_argument("--batch-size", type=_positive_int, default=16, help="sequences per step (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="model init and corpus seed (default 0)")
    parser.add_argument("--lr", type=_positive_float, default=None,
                        help=f"peak learning rate (default adam {DEFAULT_LR['adam']}, sgd {DEFAULT_LR['sgd']})")
    parser.add_argument("--log-every", type=_positive_int, default=None,
                        help="print every N steps (default: steps / 10)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def demo_optimizer_config(args: argparse.Namespace):
    import graphstep as gs

    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    precision = {"bf16": {"bf16": True},
                 # Megatron's 2**32 start would skip ~30 steps backing off; the demo's grads fit 2**16.
                 "fp16": {"fp16": True, "initial_loss_scale": 2.0**16}}.get(args.precision, {})
    return gs.OptimizerConfig(optimizer=args.optimizer, lr=lr, weight_decay=DEFAULT_WEIGHT_DECAY[args.optimizer],
                              adam_beta1=0.9, adam_beta2=0.95, sgd_momentum=0.9, clip_grad=1.0,
                              capture=args.capture, **precision)


def warmup_cosine(steps: int, warmup: int, floor: float = 0.1):
    """LR multiplier: linear warm-up, then cosine down to ``floor`` of the peak (for LambdaLR)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


class StepTimer:
    """ms per step without a host sync per step: wall clock on the CPU (its kernels run synchronously),
    CUDA events on a GPU, read only when asked."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
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


def cmd_demo(args: argparse.Namespace) -> int:
    run_demo(args)
    return 0


def run_demo(args: argparse.Namespace, out=None) -> DemoSummary:
    import graphstep as gs

    out = out or sys.stdout
    device = torch.device(args.device)
    model_config = models.preset(args.preset)
    model = models.GPT(model_config, seed=args.seed).to(device)
    corpus = models.SyntheticCorpus(model_config.vocab_size, seed=args.seed)
    config = demo_optimizer_config(args)
    opt = gs.get_optimizer(config, model)  # params become views of the engine's flat buffers
    warmup = max(1, min(50, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps, warmup))
    log_every = args.log_every or max(1, args.steps // 10)
    print(f"graphstep demo: GPT {args.preset} ({model.num_params() / 1e6:.2f}M params, {model_config.n_layers} "
          f"layers, d_model {model_config.d_model}), {args.optimizer} lr {config.lr:g} wd {config.weight_decay:g}, {args.precision}, "
          f"capture={args.capture}, batch {args.batch_size}x{model_config.seq_len}, {args.steps} steps on "
          f"{device}", file=out, flush=True)
    print(f"corpus: Markov chain over {model_config.vocab_size} tokens; loss starts near "
          f"ln({model_config.vocab_size}) = {math.log(model_config.vocab_size):.2f}, floor "
          f"{corpus.entropy_rate():.2f}", file=out, flush=True)

    if args.precision == "fp16" and device.type == "cpu":
        print("note: most CPUs have no native fp16 arithmetic, so fp16 steps are many times slower than fp32 "
              "here (bf16 is the fast half precision on CPU); try --steps 20", file=out, flush=True)

    timer = StepTimer(device)
    skipped = torch.zeros((), dtype=torch.int64, device=device)  # counted on device: no sync per step
    interval_loss = torch.zeros((), dtype=torch.float32, device=device)
    interval_steps, first_loss, last_mean = 0, math.nan, math.nan
    for step in range(args.steps):
        inputs, targets = corpus.batch(step, args.batch_size, model_config.seq_len, device)
        started = timer.start()
        loss = model(inputs, targets)
        opt.scale_loss(loss).backward()  # times the loss scale with fp16; the loss itself otherwise
        result = opt.step()  # device tensors only: no sync
        sched.step()  # writes the next lr into param_groups; the engine copies it to a device tensor
        opt.zero_grad()
        skipped += ~result.update_successful
        interval_loss += loss.detach()
        interval_steps += 1
        timer.stop(started)
        if step == 0 or (step + 1) % log_every == 0 or step + 1 == args.steps:
            last_mean = interval_loss.item() / interval_steps  # host sync: read the loss to print it
            times = timer.collect()  # host sync on CUDA (waits for the timing events)
            if step == 0:
                first_loss = last_mean
            recent = times[-interval_steps:]
            print(f"step {step + 1:5d}  loss {last_mean:.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                  f"{statistics.median(recent):7.1f} ms/step", file=out, flush=True)
            interval_loss.zero_()
            interval_steps = 0

    summary = DemoSummary(steps=args.steps, first_loss=first_loss, final_loss=last_mean,
                          loss_floor=corpus.entropy_rate(), median_ms=statistics.median(timer.collect()),
                          skipped=int(skipped.item()),  # host sync: once, at the end
                          backend=opt.capture_backend)
    print(f"done: {summary.steps} steps, final loss {summary.final_loss:.4f} (first {summary.first_loss:.4f}, "
          f"floor {summary.loss_floor:.2f}), median {summary.median_ms:.1f} ms/step, "
          f"{summary.skipped} steps skipped, optimizer step ran {summary.backend}", file=out, flush=True)
    return summary


# ---- bench -----------------------------------------------------------------------------------------------
BENCH_SCRIPT = Path("perf") / "bench_step.py"


def find_bench_script() -> Optional[Path]:
    """perf/bench_step.py of the checkout this package was imported from (perf/ is not installed)."""
    candidate = Path(__file__).resolve().parent.parent / BENCH_SCRIPT
    return candidate if candidate.is_file() else None


def cmd_bench(args: argparse.Namespace, forwarded: Sequence[str] = ()) -> int:
    script = find_bench_script()
    if script is None:
        print(f"graphstep bench: {BENCH_SCRIPT} is not installed with the package; from a checkout of "
              f"graphstep run `python {BENCH_SCRIPT} --help`", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("graphstep_bench_step", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return int(module.main(list(forwarded)) or 0)


# ---- entry point -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphstep",
                                     description="The optimizer step as one replayable graph: demo and bench.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser("demo", help="train the built-in small GPT on CPU with the engine",
                               description="Train the built-in GPT on its synthetic corpus with graphstep.")
    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)
    # Every flag after `bench` (--help included) goes to perf/bench_step.py's own parser.
    bench = commands.add_parser("bench", add_help=False, help="optimizer-step benchmark (perf/bench_step.py; "
                                "`graphstep bench --help` for its flags)")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.func(args)
