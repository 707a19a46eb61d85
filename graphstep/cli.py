"""``graphstep`` on the command line: one function per subcommand.

    graphstep demo    [--steps 300] [--preset tiny] [--precision fp32|bf16|fp16] [--capture both|eager|graph|auto]
                      [--optimizer adam|sgd] [--world-size 1] [--batch-size 16] [--seed 0] [--lr ...]
                      [--log-every ...] [--out graphstep-demo]
    graphstep profile [--steps 10] [--preset tiny] [--capture eager|graph] [--precision ...] [--out DIR]
    graphstep bench   [flags of perf/bench_step.py]     (from a checkout: perf/ is not installed)

``demo`` trains the built-in GPT (graphstep.models) on its synthetic corpus with the engine, by default
twice, eager and captured (same seed, same batches), shows a progress bar, writes a loss-curve PNG and
prints a summary table; the two runs must be bitwise equal (exit status 1 if not). The training loop is
in graphstep/demo.py, the table and the plot in graphstep/demo_report.py, the ranks of
``--world-size N`` in graphstep/demo_dist.py. ``profile`` runs graphstep.profiling.run_profile.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import models
from .demo import PRECISIONS, DemoSettings, ProgressBar, RunResult, log_interval, train, warmup_cosine  # noqa: F401

CAPTURES = ("both", "eager", "graph", "auto")

# ---- demo ------------------------------------------------------------------------------------------------
def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=_positive_int, default=300, help="training steps (default 300)")
    parser.add_argument("--preset", choices=sorted(models.PRESETS), default="tiny", help="model size (default tiny)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="model params: fp32, or bf16/fp16 with fp32 main params (fp16 adds dynamic loss "
                             "scaling); default fp32")
    parser.add_argument("--capture", choices=CAPTURES, default="both",
                        help="how the optimizer step runs (OptimizerConfig.capture); 'both' (default) trains "
                             "twice, eager then graph, and checks that the two are bitwise equal")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="default adam")
    parser.add_argument("--world-size", type=_positive_int, default=1,
                        help="data-parallel ranks: N > 1 spawns N gloo ranks on 127.0.0.1 with the distributed "
                             "optimizer, each training on its slice of each global batch (default 1: in-process)")
    parser.add_argument("--batch-size", type=_positive_int, default=16,
                        help="sequences per step, over all ranks (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="model init and corpus seed (default 0)")
    parser.add_argument("--lr", type=_positive_float, default=None,
                        help="peak learning rate (default adam 1e-3, sgd 0.1)")
    parser.add_argument("--log-every", type=_positive_int, default=None,
                        help="progress line every N steps when not on a terminal (default: steps / 10)")
    parser.add_argument("--out", default="graphstep-demo", help="folder for loss.png (default graphstep-demo/)")
    parser.add_argument("--timeout", type=_positive_float, default=600.0,
                        help="with --world-size > 1: seconds the whole run may take before the ranks are "
                             "stopped (collectives time out after 120 s); default 600")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="intra-op CPU threads (default: torch's, one per core); 1 is many times faster "
                             "when another job keeps a core busy")
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


def settings_from(args: argparse.Namespace) -> DemoSettings:
    return DemoSettings(steps=args.steps, preset=args.preset, precision=args.precision, optimizer=args.optimizer,
                        batch_size=args.batch_size, seed=args.seed, lr=args.lr, log_every=args.log_every,
                        device=args.device)


def cmd_demo(args: argparse.Namespace, out=None) -> int:
    from .demo import optimizer_config
    from .demo_report import compare, plot_losses, summary_table

    out = out or sys.stdout
    settings = settings_from(args)
    captures = ("eager", "graph") if args.capture == "both" else (args.capture,)
    world = args.world_size
    if settings.batch_size % world:
        print(f"graphstep demo: --batch-size {settings.batch_size} must be a multiple of --world-size {world}",
              file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model_config = models.preset(settings.preset)
    num_params = sum(p.numel() for p in models.GPT(model_config).parameters())
    config = optimizer_config(settings, "eager")
    ranks = f"{world} gloo ranks x {settings.batch_size // world}" if world > 1 else f"batch {settings.batch_size}"
    print(f"graphstep demo: GPT {settings.preset} ({num_params / 1e6:.2f}M params, {model_config.n_layers} layers, "
          f"d_model {model_config.d_model}), {settings.optimizer} lr {config.lr:g} wd {config.weight_decay:g}, "
          f"{settings.precision}, {ranks}x{model_config.seq_len}, {settings.steps} steps on {settings.device}"
          f"{f' ({torch.get_num_threads()} thread' + 's' * (torch.get_num_threads() > 1) + ')' if world == 1 and settings.device == 'cpu' else ''}, "
          f"capture: {' then '.join(captures)}", file=out, flush=True)
    floor = models.SyntheticCorpus(model_config.vocab_size, seed=settings.seed).entropy_rate()
    print(f"corpus: Markov chain over {model_config.vocab_size} tokens; loss starts near "
          f"ln({model_config.vocab_size}) = {math.log(model_config.vocab_size):.2f}, floor {floor:.2f}",
          file=out, flush=True)
    if settings.precision == "fp16" and settings.device == "cpu":
        print("note: most CPUs have no native fp16 arithmetic, so fp16 steps are many times slower than fp32 "
              "here (bf16 is the fast half precision on CPU); try --steps 20", file=out, flush=True)

    busy = _busy_cores()
    if world == 1 and settings.device == "cpu" and torch.get_num_threads() > 1 and busy:
        print(f"note: {busy}: {torch.get_num_threads()} intra-op threads wait on each other for many times "
              f"the step time when another job holds a core; try --threads 1", file=out, flush=True)
    if world > 1:
        print(f"progress: rank 0's loss on its slice; the summary: the global batch's", file=out, flush=True)
    bar = ProgressBar(out)
    every = bar.tty_every(settings.steps, log_interval(settings))
    if world == 1:
        results = [train(settings, capture, bar, every) for capture in captures]
    else:
        from .demo_dist import RankFailure, run_ranks

        try:
            results = run_ranks(settings, captures, world, every, bar, deadline_s=args.timeout)
        except RankFailure as exc:
            print(f"graphstep demo --world-size {world} failed: {exc}", file=sys.stderr)
            return 1

    last = log_interval(settings)
    print(f"\nsummary ({settings.steps} steps; final loss: mean of the last {last} steps, floor {floor:.2f}"
          f"{f'; {world} ranks, loss of the global batch' if world > 1 else ''}):", file=out)
    print(summary_table(results, last), file=out)
    status = 0
    if world > 1:
        same = all(r.params_same_on_all_ranks for r in results)
        print(f"params bitwise identical on all {world} ranks: {same}", file=out)
        status = 0 if same else 1
    verdict = compare(results)
    if verdict is not None:
        equal, message = verdict
        print(message, file=out)
        status = status if equal else 1
    title = (f"graphstep demo: GPT {settings.preset}, {settings.optimizer}, {settings.precision}"
             f"{f', {world} ranks' if world > 1 else ''}, {settings.steps} steps")
    png = plot_losses(results, Path(args.out) / "loss.png", title, floor)
    print(f"loss curve: {png}", file=out, flush=True)
    return status


def _busy_cores() -> str:
    """'the N cores are busy' when the load average says another job is running, else ''."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return ""
    return f"the {cores} cores are busy (1-min load average {load:.1f})" if load > cores - 0.5 else ""


# ---- profile ---------------------------------------------------------------------------------------------
def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=_positive_int, default=10, help="profiled steps (default 10)")
    parser.add_argument("--preset", choices=sorted(models.PRESETS), default="tiny", help="model size (default tiny)")
    parser.add_argument("--capture", choices=("eager", "graph"), default="eager",
                        help="eager shows one range per stage; graph one range per replayed step (default eager)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help="default fp32")
    parser.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--out", default="graphstep-profile", help="folder for trace.json (default graphstep-profile/)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")


def cmd_profile(args: argparse.Namespace, out=None) -> int:
    from .profiling import run_profile

    run_profile(steps=args.steps, preset=args.preset, capture=args.capture, precision=args.precision,
                batch_size=args.batch_size, out_dir=args.out, device=args.device, out=out or sys.stdout)
    return 0


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
                                     description="The optimizer step as one replayable graph: demo, profile, bench.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser("demo", help="train the built-in small GPT on CPU, eager and captured",
                               description="Train the built-in GPT on its synthetic corpus with graphstep, eager "
                                           "and captured side by side.")
    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)
    profile = commands.add_parser("profile", help="K steps with a range per stage: Chrome trace, NVTX, NVML",
                                  description="Profile K steps of the built-in GPT: a torch.profiler Chrome trace "
                                              "with a range per stage and per step, NVTX ranges and a "
                                              "cudaProfilerStart/Stop window on CUDA, NVML telemetry.")
    add_profile_arguments(profile)
    profile.set_defaults(func=cmd_profile)
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
