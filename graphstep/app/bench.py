"""The optimizer step, side by side in one process, on GPT-2 small's parameter shapes (``graphstep bench``).

Every row runs over the same params and the same random grads, restored untimed before each step. The rows:
two bandwidth floors (a memory stream ``x.mul_``, a read-only ``x.sum()``) and graphstep's norm pass alone;
``torch._fused_adamw_`` over one flat buffer (the floor an Adam step can reach, docs/design.md §6); torch's
AdamW (fused, foreach, fused after ``clip_grad_norm_``); a backward stand-in with and without the folded norm;
graphstep's step unclipped and full, eager and captured, with each kernel. graphstep's rows run unfolded unless
they say folded; "the default config" rows run the defaults.

GB/s is the bytes a row must move (Adam over fp32: 28 B per param; the full step reads the grads once more
for the norm: 32 B) over its median time. One pipeline is built at a time; ``--interleave`` builds all at once.

    graphstep bench [--quick] [--steps 20] [--warmup 3] [--json out.json] [--only fused-floor,...]
    python perf/bench_step.py [same flags]    # the same, from a checkout
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from . import bench_core as core
from . import bench_shapes
from .bench_rows import Row, add_ratios, key_ratios, markdown
from .options import add_device_argument, nonnegative_int, positive_int, resolve_device

FULL_BYTES = core.GRAPHSTEP_BYTES
DEFAULT = None  # build_graphstep's kernel=None: the config's default, kernel="auto"
# key: (label, kind, bytes per param, builder). Builders return a bench_core.Pipeline.
PIPELINES = {
    "stream": ("memory stream: x.mul_(1.0001), same numel", "stream", core.STREAM_BYTES,
               lambda i: core.build_stream(i.numel, i.device)),
    # The norm pass reads the grads once (4 B): the floor it can reach is a plain read-only reduction.
    "read-floor": ("read-only reduction: x.sum(), same numel (floor of a read)", "read", core.NORM_BYTES,
                   core.build_read_floor),
    "norm-pass": ("graphstep norm/inf pass alone (sum of squares, non-finite check)", "read", core.NORM_BYTES,
                  core.build_graphstep_norm_pass),
    "fused-floor": ("torch._fused_adamw_, one flat buffer (floor)", "update", core.ADAM_BYTES,
                    core.build_fused_floor),
    "adamw-fused": ("torch AdamW(fused=True)", "update", core.ADAM_BYTES,
                    lambda i: core.build_torch_adamw(i, fused=True)),
    "adamw-foreach": ("torch AdamW(foreach=True)", "update", core.ADAM_BYTES,
                      lambda i: core.build_torch_adamw(i, fused=False)),
    # clip_grad=0 turns the clip off but not the norm pass: it doubles as the non-finite check, so the
    # engine still reads the grads once more than a bare update (32 B, not 28).
    "graphstep-update": ("graphstep, no clip (eager, clip_grad=0; norm/inf check still run), unfolded, default kernel",
                         "update", FULL_BYTES, lambda i: core.build_graphstep(i, clip_grad=0.0, kernel=DEFAULT)),
    "adamw-fused-clip": ("torch clip_grad_norm_ + AdamW(fused=True)", "full", FULL_BYTES,
                         lambda i: core.build_torch_adamw(i, fused=True, clip=True)),
    # The full step rows: the default kernel ("auto": compiled where torch.compile works), and each kernel
    # by name. torch's fused kernels write the divided grads back whenever given a grad scale, i.e. on every
    # clipped or loss-scaled step (36 B); the compiled loop reads them without writing (32 B).
    "graphstep-full": ("graphstep, full step (eager, clip_grad=1.0), unfolded, default kernel", "full", FULL_BYTES,
                       lambda i: core.build_graphstep(i, kernel=DEFAULT)),
    "graphstep-full-folded": ("graphstep, full step (eager, clip_grad=1.0): the default config (folded norm, "
                              "kernel auto)", "full", core.ADAM_BYTES,
                              lambda i: core.build_graphstep(i, kernel=DEFAULT, fold=True)),
    "graphstep-full-graph": ("graphstep, full step (capture='graph'), unfolded, default kernel", "full", FULL_BYTES,
                             lambda i: core.build_graphstep(i, capture="graph", kernel=DEFAULT)),
    "graphstep-full-fused": ("graphstep, full step, unfolded, kernel='fused' (eager)", "full", FULL_BYTES,
                             lambda i: core.build_graphstep(i, kernel="fused")),
    "graphstep-full-compiled": ("graphstep, full step, unfolded, kernel='compiled' (eager)", "full",
                                FULL_BYTES, lambda i: core.build_graphstep(i, kernel="compiled")),
    "graphstep-full-compiled-graph": ("graphstep, full step, unfolded, kernel='compiled' (capture='graph')", "full",
                                      FULL_BYTES, lambda i: core.build_graphstep(i, capture="graph", kernel="compiled")),
    "graphstep-update-stage": ("graphstep update stage alone (fused kernel over group views)", "update",
                               core.ADAM_BYTES, core.build_graphstep_update_stage),
    "torch-amp": ("torch GradScaler.unscale_ + clip_grad_norm_ + AdamW(fused) + update", "scaled",
                  core.TORCH_AMP_BYTES, lambda i: core.build_torch_amp(i)),
    "graphstep-scaled": ("graphstep full step with loss scale, unfolded (fold_grad_norm=False), default kernel",
                         "scaled", FULL_BYTES,
                         lambda i: core.build_graphstep(i, loss_scale=core.LOSS_SCALE, kernel=DEFAULT)),
    "graphstep-scaled-fused": ("graphstep full step with loss scale, unfolded, kernel='fused'", "scaled", FULL_BYTES,
                               lambda i: core.build_graphstep(i, loss_scale=core.LOSS_SCALE, kernel="fused")),
    "graphstep-scaled-compiled": ("graphstep full step with loss scale, unfolded, kernel='compiled'", "scaled",
                                  FULL_BYTES,
                                  lambda i: core.build_graphstep(i, loss_scale=core.LOSS_SCALE, kernel="compiled")),
    # fold_grad_norm: the norm is folded into backward (its hooks), so the step reads the grads once (28 B);
    # the refill before each timed step is the backward stand-in, whose hooks fold (untimed).
    "graphstep-scaled-folded": ("graphstep full step with loss scale: the default config (folded norm, kernel auto)",
                                "scaled", core.ADAM_BYTES,
                                lambda i: core.build_graphstep(i, loss_scale=core.LOSS_SCALE, kernel=DEFAULT,
                                                               fold=True)),
    # The default config with grads written by a copy instead of a backward: the fold's units are then
    # folded by the step itself, as a buffer-wide read (how benchmarks that compare optimizers drive it).
    "graphstep-scaled-folded-copied": ("graphstep full step with loss scale: the default config, grads copied in "
                                       "(no backward: the step folds)", "scaled", FULL_BYTES,
                                       lambda i: core.build_graphstep(i, loss_scale=core.LOSS_SCALE, kernel=DEFAULT,
                                                                      fold=True, timed="step-after-copy")),
    # The same with param_checks="on_request": no per-param reads after the first step (the host work that
    # grows with the number of params).
    "graphstep-scaled-folded-copied-on-request": (
        "graphstep full step with loss scale, grads copied in, param_checks='on_request'", "scaled", FULL_BYTES,
        lambda i: core.build_graphstep(i, loss_scale=core.LOSS_SCALE, kernel=DEFAULT, fold=True,
                                       timed="step-after-copy", param_checks="on_request")),
    # What the fold costs backward, and backward + step together, with and without it.
    "backward": ("backward stand-in (zero_grad + every grad accumulated through autograd), unfolded", "backward",
                 core.BACKWARD_BYTES,
                 lambda i: core.build_graphstep(i, loss_scale=core.LOSS_SCALE, kernel=DEFAULT, timed="backward")),
    "backward-folded": ("backward stand-in, folded norm (the default: folded in its hooks)", "backward",
                        core.BACKWARD_BYTES + core.NORM_BYTES,
                        lambda i: core.build_graphstep(i, loss_scale=core.LOSS_SCALE, kernel=DEFAULT, fold=True,
                                                       timed="backward")),
    "backward-step": ("backward stand-in + full step with loss scale, unfolded, default kernel", "train",
                      core.BACKWARD_BYTES + FULL_BYTES,
                      lambda i: core.build_graphstep(i, loss_scale=core.LOSS_SCALE, kernel=DEFAULT,
                                                     timed="backward+step")),
    "backward-step-folded": ("backward stand-in + full step with loss scale, the default config (folded)",
                             "train", core.BACKWARD_BYTES + FULL_BYTES,
                             lambda i: core.build_graphstep(i, loss_scale=core.LOSS_SCALE, kernel=DEFAULT,
                                                            fold=True, timed="backward+step")),
}


def new_row(key: str) -> Row:
    label, kind, nbytes, _ = PIPELINES[key]
    return Row(key, label, kind, nbytes)


def run_pipeline(key: str, inputs: core.Inputs, warmup: int, steps: int) -> Row:
    """One row built, timed and freed on its own."""
    return run_interleaved([key], inputs, warmup, steps)[0]


def run_interleaved(keys: list[str], inputs: core.Inputs, warmup: int, rounds: int) -> list[Row]:
    """Every row of ``keys`` built at once and timed round-robin (see ``bench_core.time_interleaved``).
    A row that fails to build or run keeps its error; the others still run."""
    rows = {key: new_row(key) for key in keys}
    steps, refills, skipped = {}, {}, {}
    for key in keys:
        try:
            pipeline = PIPELINES[key][3](inputs)
            steps[key] = pipeline.step
            if pipeline.refill is not None:  # fresh grads before every step, untimed, as after a backward
                refills[key] = pipeline.refill
            if pipeline.skipped_steps is not None:
                skipped[key] = pipeline.skipped_steps
            if pipeline.notes:
                print(f"  {key}: {pipeline.notes}", file=sys.stderr, flush=True)
        except Exception as error:  # a broken row must not lose the others
            rows[key].error = f"{type(error).__name__}: {error}"
    try:
        times = core.time_interleaved(steps, inputs.device, warmup, rounds, refills) if steps else {}
        for key, counter in skipped.items():  # once, after the timing's own synchronisation
            rows[key].skipped_steps = int(counter.item())
    except Exception as error:
        times = {}
        for key in steps:
            rows[key].error = f"{type(error).__name__}: {error}"
    finally:
        steps = refills = skipped = None
        core.free_memory(inputs.device)
    return [rows[key].fill(times[key], inputs.numel) if key in times else rows[key] for key in keys]


# The help's text: plain, since argparse prints it as written (the module docstring is reST for readers of the code).
DESCRIPTION = textwrap.fill(
    "The optimizer step, side by side in one process, on GPT-2 small's parameter shapes (or --shapes): torch's "
    "AdamW (fused, foreach, after clip_grad_norm_, under a GradScaler) and graphstep's step (eager and captured, "
    "with each kernel, with and without the norm folded into backward), over the same params and grads, with a "
    "memory stream and a read-only reduction as this machine's bandwidth floors. Each row says how many bytes per "
    "param it must move and the GB/s it reached; what each row runs: the docstring of graphstep/app/bench.py.", 78)

EPILOG = """\
examples:
  graphstep bench --quick --steps 5        # smoke run: 10M params, every row
  graphstep bench --interleave --steps 25 \\
      --only read-floor,norm-pass,fused-floor,graphstep-scaled
  python perf/bench_step.py --quick        # the same, from a checkout"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphstep bench", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=sorted(bench_shapes.SETS), default="gpt2-small",
                        help="parameter-shape set (graphstep/app/bench_shapes.py); default gpt2-small")
    parser.add_argument("--quick", action="store_true", help="the small gpt2-quick set, 10 steps")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="timed steps per row (default 20, quick 10)")
    parser.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed steps before timing (default 3)")
    add_device_argument(parser)
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--only", default=None,
                        help="comma-separated row keys to run, of: " + ", ".join(PIPELINES))
    parser.add_argument("--repeat", type=positive_int, default=1,
                        help="run every row this many times, round-robin, and keep each row's fastest run "
                             "(its lowest median): steadier on a shared, noisy machine (default 1)")
    parser.add_argument("--interleave", action="store_true",
                        help="build every row at once and time them round-robin, one step of each per round "
                             "(--steps rounds): the steadiest ratios on a shared machine; needs memory for "
                             "all rows at once (~2 GB each at GPT-2 small), so pick rows with --only")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random initial params and grads every row starts from (default 0)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    return parser


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes = "gpt2-quick"
    if args.steps is None:
        args.steps = 10 if args.quick else 20
    if args.interleave and args.repeat > 1:
        parser.error("--interleave times every row in the same rounds: raise --steps instead of --repeat")
    keys = list(PIPELINES) if args.only is None else [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in keys if k not in PIPELINES]
    if unknown:
        parser.error(f"--only: unknown row(s) {', '.join(unknown)}; choose from {', '.join(PIPELINES)}")
    args.keys = keys
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    # The rows fill the grads directly, with no backward: graphstep's "step() ran before any backward"
    # warning is expected here and would only clutter the table.
    warnings.filterwarnings("ignore", message=r"graphstep: step\(\) ran before any backward")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(resolve_device(args.device))
    shapes = bench_shapes.SETS[args.shapes]()
    inputs = core.Inputs(shapes, device, args.seed)
    meta = {"shapes": args.shapes, "numel": inputs.numel, "tensors": len(shapes), "device": core.device_name(device),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "steps": args.steps,
            "warmup": args.warmup, "repeat": args.repeat, "interleave": args.interleave}
    best: dict[str, Row] = {}
    if args.interleave:
        print(f"running {', '.join(args.keys)} interleaved ...", file=sys.stderr, flush=True)
        best = {row.key: row for row in run_interleaved(args.keys, inputs, args.warmup, args.steps)}
    for repeat in range(0 if args.interleave else args.repeat):
        for key in args.keys:
            print(f"running {key} ({repeat + 1}/{args.repeat}) ...", file=sys.stderr, flush=True)
            row = run_pipeline(key, inputs, args.warmup, args.steps)
            kept = best.get(key)
            if kept is None or kept.error or (not row.error and row.median_ms < kept.median_ms):
                best[key] = row
    rows = [best[key] for key in args.keys]
    add_ratios(rows)
    # A bootstrap per ratio: computed once, for the table and the JSON.
    paired = key_ratios(rows) if args.interleave else []
    print(markdown(rows, meta, paired))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows], "key_ratios": paired},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
