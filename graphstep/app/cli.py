"""``graphstep`` on the command line: one function per subcommand (``demo``, ``profile``, ``bench``, ``config``)
and ``main``, which parses the arguments and routes them. docs/command-line.md says what each subcommand does;
``graphstep COMMAND --help`` lists its flags and defaults.

``profile`` runs profiling.run_profile; ``bench`` hands every argument to graphstep.app.bench's own parser;
``config --list`` prints every OptimizerConfig field, its default and meaning (graphstep/config/reference.py;
docs/config.md). Without ``--out``, ``demo`` and ``profile`` write to options.default_out_dir: out/<kind> from
the root of a checkout (git ignores out/), else the system temp dir. ``--device`` is one definition
(options.add_device_argument) in ``demo``, ``profile`` and ``bench``, default "auto": the accelerator torch
finds, else the CPU; the demo's gloo ranks (``--world-size`` > 1) train on the CPU unless it names another device.
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

import graphstep as gs

from . import models
from .demo import (DEMO_QK_CLIP_THRESHOLD, MOMENT_DTYPES, DemoSettings, ProgressBar, estimate_seconds, log_interval,
                   optimizer_config, train)
from .options import (AUTO_DEVICE, add_device_argument, default_out_dir, out_help, package_version, positive_float,
                      positive_int, resolve_device)
from .precision import PRECISIONS

CAPTURES = ("both", "eager", "graph", "auto")
SCOPES = ("step", "iteration")

# ---- demo ------------------------------------------------------------------------------------------------
def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    # 200 steps x 2 runs of the tiny preset: well under a minute on an idle 2-core CPU, loss 5.5 -> ~1.9
    parser.add_argument("--steps", type=positive_int, default=200, help="training steps (default 200)")
    parser.add_argument("--preset", choices=sorted(models.PRESETS), default="tiny", help="model size (default tiny)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="model params: fp32, or bf16/fp16 with fp32 main params (fp16 adds dynamic loss "
                             "scaling), or fp8 (the hidden Linear weights in fp8 with per-tensor scales, "
                             "requantized in the step; the rest bf16); default fp32")
    parser.add_argument("--moments", choices=tuple(MOMENT_DTYPES), default="fp32",
                        help="Adam's moments stored in fp32 (default) or, with the precision-aware optimizer, "
                             "bf16, fp16 or fp8 (OptimizerConfig.exp_avg_dtype / exp_avg_sq_dtype)")
    parser.add_argument("--capture", choices=CAPTURES, default="both",
                        help="how the optimizer step runs (OptimizerConfig.capture); 'both' (default) trains "
                             "twice, eager then graph, and checks that the two are bitwise equal")
    parser.add_argument("--scope", choices=SCOPES, default="step",
                        help="what --capture captures: 'step' (default) the optimizer step, or 'iteration' the whole "
                             "iteration (forward, backward and step as one graph, graphstep.Iteration)")
    parser.add_argument("--optimizer", choices=("adam", "sgd", "muon"), default="adam",
                        help="default adam; muon trains the hidden matrices with Muon and the rest with Adam")
    parser.add_argument("--qk-clip", action="store_true",
                        help="QK-clip (MuonClip): the attention records its max logits and the step rescales "
                             f"W_q/W_k so that none exceeds {DEMO_QK_CLIP_THRESHOLD:g}")
    parser.add_argument("--world-size", type=positive_int, default=1,
                        help="data-parallel ranks: N > 1 spawns N gloo ranks on 127.0.0.1 with the distributed "
                             "optimizer, each training on its slice of each global batch, on the CPU unless "
                             "--device names another (default 1: in-process)")
    parser.add_argument("--batch-size", type=positive_int, default=16,
                        help="sequences per step, over all ranks (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="model init and corpus seed (default 0)")
    parser.add_argument("--lr", type=positive_float, default=None,
                        help="peak learning rate (default adam 1e-3, sgd 0.1, muon 3e-3)")
    parser.add_argument("--log-every", type=positive_int, default=None,
                        help="progress line every N steps when not on a terminal (default: steps / 10)")
    parser.add_argument("--out", default=None, help=out_help("demo", "loss.png"))
    parser.add_argument("--timeout", type=positive_float, default=600.0,
                        help="with --world-size > 1: seconds the whole run may take before the ranks are "
                             "stopped (collectives time out after 120 s); default 600")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="intra-op CPU threads (default: torch's, one per core, or 1 when the load average "
                             "says another job keeps the cores busy: then 1 is many times faster)")
    add_device_argument(parser)


def settings_from(args: argparse.Namespace) -> DemoSettings:
    # gloo ranks share the host: "auto" puts them on the CPU (another device only when named)
    ranks_on_cpu = args.world_size > 1 and args.device == AUTO_DEVICE
    return DemoSettings(steps=args.steps, preset=args.preset, precision=args.precision, moments=args.moments,
                        optimizer=args.optimizer, qk_clip=args.qk_clip, batch_size=args.batch_size, seed=args.seed,
                        lr=args.lr, log_every=args.log_every, scope=args.scope,
                        device="cpu" if ranks_on_cpu else resolve_device(args.device))


def cmd_demo(args: argparse.Namespace, out=None) -> int:
    """Train the built-in GPT (graphstep.app.models) on its synthetic corpus with the engine, by default twice,
    eager and captured (same seed, same batches). Says up front roughly how long that takes and where its
    output goes, shows a progress bar, writes a loss-curve PNG (matplotlib, the ``app`` extra) and prints a
    summary table; exit status 1 when the runs are not bitwise equal. The training loop is in demo.py, the
    table and the plot in demo_report.py, the ranks of ``--world-size N`` in demo_dist.py."""
    from .demo_report import compare, plot_losses, summary_table

    out = out or sys.stdout
    settings = settings_from(args)
    captures = ("eager", "graph") if args.capture == "both" else (args.capture,)
    world = args.world_size
    if settings.batch_size % world:
        print(f"graphstep demo: --batch-size {settings.batch_size} must be a multiple of --world-size {world}",
              file=sys.stderr)
        return 2
    notes = []
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif world == 1 and torch.device(settings.device).type == "cpu" and torch.get_num_threads() > 1:
        busy = _busy_cores()
        # With another job on a core, the threads wait on each other at every parallel op (docs/perf-notes.md).
        if busy:
            notes.append(f"{busy}, so 1 intra-op thread: {torch.get_num_threads()} would wait on each other for "
                         f"many times the step time while another job holds a core (--threads N to choose)")
            torch.set_num_threads(1)
    out_dir = Path(args.out) if args.out is not None else default_out_dir("demo")
    floor = _print_intro(settings, captures, world, out_dir, notes, out)

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
    if any(r.skipped for r in results):
        print(f"skipped steps: {', '.join(f'{r.label} {r.skipped} of {settings.steps}' for r in results)} "
              f"(non-finite grads: params, optimizer state and step count left unchanged)", file=out)
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
    if _has_matplotlib():
        moments = f", {settings.moments} moments" if settings.moments != "fp32" else ""
        title = (f"graphstep demo: GPT {settings.preset}, {settings.optimizer}{moments}, {settings.precision}"
                 f"{f', {world} ranks' if world > 1 else ''}, {settings.steps} steps")
        png = plot_losses(results, out_dir / "loss.png", title, floor)
        print(f"loss curve: {png}", file=out, flush=True)
    return status


def _print_intro(settings: DemoSettings, captures: Sequence[str], world: int, out_dir: Path,
                 notes: Sequence[str], out) -> float:
    """What is about to run (and ``notes`` on how), how long it should take and where its output goes;
    returns the corpus's entropy rate (the loss floor)."""
    model_config = models.preset(settings.preset)
    num_params = models.GPT(model_config).num_params()
    config = optimizer_config(settings, "eager")
    on_cpu = torch.device(settings.device).type == "cpu"
    threads = torch.get_num_threads()
    ranks = f"{world} gloo ranks x {settings.batch_size // world}" if world > 1 else f"batch {settings.batch_size}"
    thread_note = f" ({threads} thread{'s' * (threads > 1)})" if world == 1 and on_cpu else ""
    print(f"graphstep demo: GPT {settings.preset} ({num_params / 1e6:.2f}M params, {model_config.n_layers} layers, "
          f"d_model {model_config.d_model}), {settings.optimizer} lr {config.lr:g} wd {config.weight_decay:g}"
          f"{f', qk-clip at {config.qk_clip_threshold:g}' if config.qk_clip else ''}, "
          f"{settings.precision}, {ranks}x{model_config.seq_len}, {settings.steps} steps on {settings.device}"
          f"{thread_note}, capture{' of the whole iteration' * (settings.scope == 'iteration')}: "
          f"{' then '.join(captures)}", file=out, flush=True)
    if settings.precision == "fp8":
        print(_fp8_param_bytes(settings), file=out, flush=True)
    floor = models.SyntheticCorpus(model_config.vocab_size, seed=settings.seed).entropy_rate()
    print(f"corpus: Markov chain over {model_config.vocab_size} tokens; loss starts near "
          f"ln({model_config.vocab_size}) = {math.log(model_config.vocab_size):.2f}, floor {floor:.2f}",
          file=out, flush=True)
    if settings.precision == "fp16" and on_cpu:
        notes = [*notes, "most CPUs have no native fp16 arithmetic, so fp16 steps are many times slower than fp32 "
                         "here (bf16 is the fast half precision on CPU); try --steps 20"]
    for note in notes:
        print(f"note: {note}", file=out, flush=True)
    seconds = estimate_seconds(settings, len(captures), world)
    print(f"time: about {_duration(seconds)} ({len(captures)} x {settings.steps} steps, from a timed "
          f"forward and backward pass on this machine now)", file=out, flush=True)
    if _has_matplotlib():
        print(f"output: {out_dir / 'loss.png'} (--out DIR to choose)", file=out, flush=True)
    else:
        print("output: no loss-curve PNG, matplotlib is not installed (pip install 'graphstep[app]')",
              file=out, flush=True)
    if world > 1:
        print("progress: rank 0's loss on its slice; the summary: the global batch's", file=out, flush=True)
    return floor


def _fp8_param_bytes(settings: DemoSettings) -> str:
    """The param bytes an fp8 run allocates, measured on an optimizer built over the same model here."""
    from .precision import cast_by_the_optimizer, param_bytes, prepare

    model = models.GPT(models.preset(settings.preset, qk_clip=settings.qk_clip), seed=settings.seed)
    prepare(model.to(settings.device), settings.precision)
    with cast_by_the_optimizer(), gs.get_optimizer(optimizer_config(settings, "eager"), model) as opt:
        return param_bytes(opt).summary()


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    return f"{seconds / 60:.0f} min"


def _has_matplotlib() -> bool:
    """Whether the app extra's matplotlib can be imported (without importing it: that takes a while)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # a module object without a spec (sys.modules["matplotlib"] = None in a test)
        return False


def _busy_cores() -> str:
    """'the N cores are busy' when the load average says another job is running, else ''."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return ""
    return f"the {cores} cores are busy (1-min load average {load:.1f})" if load > cores - 0.5 else ""


# ---- profile ---------------------------------------------------------------------------------------------
def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=positive_int, default=10, help="profiled steps (default 10)")
    parser.add_argument("--preset", choices=sorted(models.PRESETS), default="tiny", help="model size (default tiny)")
    parser.add_argument("--capture", choices=("eager", "graph"), default="eager",
                        help="eager shows one range per stage; graph one range per replayed step (default eager)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32", help="default fp32")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--scope", choices=SCOPES, default="step",
                        help="'step' (default): the loop calls opt.step(); 'iteration': graphstep.Iteration runs "
                             "forward, backward and step (eager: a range per micro-batch's forward and backward "
                             "and one around the step; graph: one range per replay)")
    parser.add_argument("--micro-batches", type=positive_int, default=2,
                        help="--scope iteration: micro-batches each batch is split into (default 2)")
    parser.add_argument("--out", default=None, help=out_help("profile", "trace.json"))
    add_device_argument(parser)


def cmd_profile(args: argparse.Namespace, out=None) -> int:
    from .profiling import run_profile

    run_profile(steps=args.steps, preset=args.preset, capture=args.capture, precision=args.precision,
                batch_size=args.batch_size, out_dir=args.out, device=resolve_device(args.device),
                out=out or sys.stdout, scope=args.scope, micro_batches=args.micro_batches)
    return 0


# ---- bench -----------------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace, forwarded: Sequence[str] = ()) -> int:
    """Every argument after ``bench`` (``--help`` included) goes to the benchmark's own parser."""
    from .bench import main as bench_main  # only this subcommand pays for importing the benchmark

    return int(bench_main(list(forwarded)) or 0)


# ---- config ----------------------------------------------------------------------------------------------
def cmd_config(args: argparse.Namespace, out=None) -> int:
    from ..config.reference import reference_markdown

    if not args.list:
        args.command_parser.print_help(out or sys.stdout)
        return 2
    (out or sys.stdout).write(reference_markdown())
    return 0


# ---- entry point -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphstep",
                                     description="The optimizer step as one replayable graph: demo, profile, bench.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser("demo", help="train the built-in small GPT, eager and captured",
                               description="Train the built-in GPT on its synthetic corpus with graphstep, eager "
                                           "and captured side by side.")
    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo, command_parser=demo)
    profile = commands.add_parser("profile", help="K steps with a range per stage: Chrome trace, NVTX, NVML",
                                  description="Profile K steps of the built-in GPT: a torch.profiler Chrome trace "
                                              "with a range per stage and per step, NVTX ranges and a "
                                              "cudaProfilerStart/Stop window on CUDA, NVML telemetry.")
    add_profile_arguments(profile)
    profile.set_defaults(func=cmd_profile, command_parser=profile)
    bench = commands.add_parser("bench", add_help=False, help="optimizer-step benchmark "
                                "('graphstep bench --help' for its flags)")
    bench.set_defaults(func=cmd_bench)
    config = commands.add_parser("config", help="OptimizerConfig's fields: --list prints each, default and meaning",
                                 description="OptimizerConfig's fields, each family's options and Megatron-Core's "
                                             "names, generated from the code.")
    config.add_argument("--list", action="store_true",
                        help="print every field, its default and meaning (Markdown: the text of docs/config.md)")
    config.set_defaults(func=cmd_config, command_parser=config)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, extra)
    if extra:  # the subcommand's usage, not the top level's: it lists the options that were meant
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
