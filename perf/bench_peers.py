"""graphstep's default step against the peers that compile instead of capture, in one interleaved run.

    python perf/bench_peers.py [--quick] [--rounds 20] [--warmup 3] [--shapes gpt2,many-small] [--rows ...]
                               [--start-limit 600] [--no-startup] [--json out.json]

Rows (what each runs: perf/peer_pipelines.py): graphstep's default config; torch's ``clip_grad_norm_`` +
fused AdamW; torch's compiled-optimizer recipe (``torch.compile`` around ``opt.step()``, the lr a tensor) with
``clip_grad_norm_`` inside the compiled function and without; heavyball's AdamW with global-norm clipping and
without, where heavyball imports (a row that cannot run says why, and the others still run); the floor, one
``torch._fused_adamw_`` over one flat buffer of the same bytes.

Shapes: GPT-2 small (124M params in 148 tensors) and 10,000 tensors of 4,096 elements; ``--quick``: the
gpt2-quick set (10M params in 52 tensors) and 10,000 tensors of 512, fewer rounds, and a GPT-2-quick startup
table (a smoke run: minutes, most of them compiling).

Per shape set all rows are built in one process, then timed round-robin (``bench_core.time_interleaved``:
one step of every row per round, the grads restored untimed before each step), so a shared machine's slow
phases fall on every row alike; the table gives medians, each row's ratio of medians to graphstep's with a
95% bootstrap interval over the rounds (``bench_stats.ratio_interval``), and its ratio to the floor. Compile
time is apart from the steady state: "build + first step" is the seconds from the row's construction to
the end of its first step (where the compiled rows compile; graphstep's probe of torch.compile runs in its
build), and the warm-up steps after it are untimed. A row not started within ``--start-limit`` seconds is given
up and says so (at 10,000 tensors the compiled peers' compiles outlast it: docs/performance.md).

Then the startup table (perf/peer_startup.py): build and first step of graphstep, torch fused AdamW + clip,
the compiled torch step with clip and heavyball with clip, each in a fresh process, with an empty inductor
cache and again with the cache that process left. ``--no-startup`` skips it.

The 1-min load average is printed before each shape set: this machine may be shared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peer_pipelines as peers  # noqa: E402  (puts the checkout's graphstep first on the path)
import peer_startup  # noqa: E402
from graphstep.app import bench_core as core  # noqa: E402
from graphstep.app import bench_shapes  # noqa: E402
from graphstep.app import bench_stats  # noqa: E402

ROWS = list(peers.BUILDERS)
STARTUP_ROWS = ["graphstep", "torch-fused-clip", "torch-compiled-clip", "heavyball-clip"]


def shape_sets(quick: bool) -> dict:
    if quick:
        return {"gpt2": ("gpt2-quick", bench_shapes.gpt2_quick()),
                "many-small": ("10,000 x 512", bench_shapes.many_tensors(10_000, 512))}
    return {"gpt2": ("gpt2-small", bench_shapes.gpt2_small()),
            "many-small": ("10,000 x 4,096", bench_shapes.tensors_10k()),
            "tiny": ("16 x 1,024", bench_shapes.many_tensors(16, 1024))}


class StartTooSlow(Exception):
    pass


@contextlib.contextmanager
def start_limit(seconds: Optional[float]):
    """Give up a row whose build and first step (where the compiled rows compile) take over ``seconds``:
    SIGALRM raises ``StartTooSlow`` out of whatever Python runs then (in the main thread). Raised again on the
    way out where a library caught it and went on, so such a row is never timed."""
    if seconds is None:
        yield
        return
    why = f"build and first step not finished within {seconds:.0f} s (given up)"
    fired = []

    def expire(signum, frame):
        fired.append(signum)
        raise StartTooSlow(why)
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if fired:
        raise StartTooSlow(why)


def run_shape(rows: list[str], inputs: core.Inputs, warmup: int, rounds: int,
              start_limit_s: Optional[float] = None) -> list[dict]:
    """Every row built (build and first step timed, each row within ``start_limit_s``), warmed up, then timed
    round-robin; a row that fails to build or run, or to start in time, keeps its error and the others go on."""
    grads = peers.SharedGrads(inputs)
    results = {row: {"row": row, "label": peers.LABELS[row]} for row in rows}
    steps, refills = {}, {}
    for row in rows:
        print(f"  building {row} ...", end="", file=sys.stderr, flush=True)
        try:
            with start_limit(start_limit_s):
                pipeline, build_s, first_s = peers.start(row, inputs, grads)
        except Exception as error:  # a broken row (heavyball missing, a compile failing) must not lose the others
            results[row]["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            print(f" failed: {results[row]['error']}", file=sys.stderr)
            continue
        results[row].update(build_s=build_s, first_step_s=first_s, notes=pipeline.notes)
        print(f" {build_s:.1f} s + first step {first_s:.1f} s {pipeline.notes}", file=sys.stderr)
        steps[row] = _no_grad(pipeline.step)
        if pipeline.refill is not None:
            refills[row] = pipeline.refill
    if steps:
        times = core.time_interleaved(steps, inputs.device, warmup, rounds, refills)
        for row, ms in times.items():
            results[row].update(bench_stats.summarize(ms), times_ms=ms)
    steps = refills = None
    core.free_memory(inputs.device)
    _add_ratios(list(results.values()))
    return list(results.values())


def _no_grad(step):
    def run():
        with torch.no_grad():
            step()
    return run


def _add_ratios(results: list[dict]) -> None:
    timed = {r["row"]: r for r in results if "times_ms" in r}
    base, floor = timed.get("graphstep"), timed.get("floor")
    for r in timed.values():
        if base is not None:
            r["vs_graphstep"], r["vs_graphstep_low"], r["vs_graphstep_high"] = bench_stats.ratio_interval(
                r["times_ms"], base["times_ms"])
        if floor is not None:
            r["vs_floor"] = r["median_ms"] / floor["median_ms"]


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(name: str, inputs: core.Inputs, results: list[dict], meta: dict) -> str:
    lines = [f"{name}: {inputs.numel / 1e6:.1f}M fp32 params in {len(inputs.shapes)} tensors, {meta['device']}, "
             f"{meta['threads']} threads, torch {meta['torch']}; {meta['rounds']} interleaved rounds after "
             f"{meta['warmup']} warm-up steps; load before: {meta['load']:.2f}", "",
             "| step | ms (median) | p10 | p90 | × graphstep (95% interval) | × floor | build + first step s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | not run: {r['error']} | | | | | |")
            continue
        interval = (f"{r['vs_graphstep']:.2f} ({r['vs_graphstep_low']:.2f}–{r['vs_graphstep_high']:.2f})"
                    if "vs_graphstep" in r else "—")
        lines.append(f"| {r['label']} | {r['median_ms']:.1f} | {r['p10_ms']:.1f} | {r['p90_ms']:.1f} | {interval} | "
                     f"{_fmt(r.get('vs_floor'), '.2f')} | {r['build_s'] + r['first_step_s']:.1f} |")
    notes = [f"{r['row']}: {r['notes']}" for r in results if r.get("notes")]
    if notes:
        lines += ["", "Notes: " + "; ".join(notes) + "."]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_peers", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes, 5 rounds, GPT-2-quick startup table")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds (default 20, quick 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each row after its first step")
    parser.add_argument("--shapes", default="gpt2,many-small",
                        help="comma-separated: gpt2, many-small (and tiny, 16 x 1,024, for tests)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    parser.add_argument("--no-startup", dest="startup", action="store_false",
                        help="skip the build + first step table (fresh processes, cold and warm inductor cache)")
    parser.add_argument("--startup-rows", default=",".join(STARTUP_ROWS), help="rows of the startup table")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds per startup process")
    parser.add_argument("--start-limit", type=float, default=600.0,
                        help="seconds a row's build and first step may take before it is given up (default 600)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (5 if args.quick else 20)
    for name, known in (("rows", ROWS), ("startup_rows", ROWS)):
        chosen = [r for r in getattr(args, name).split(",") if r]
        unknown = [r for r in chosen if r not in known]
        if unknown:
            parser.error(f"--{name.replace('_', '-')}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
        setattr(args, name, chosen)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=r"graphstep: step\(\) ran before any backward")  # grads copied in
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    sets = shape_sets(args.quick)
    heavyball = peers.heavyball_problem() or f"heavyball {peers.heavyball_version()}"
    out = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "heavyball": heavyball, "shapes": {}}
    texts = [f"heavyball: {heavyball}"]
    for key in [s for s in args.shapes.split(",") if s]:
        name, shapes = sets.get(key) or shape_sets(False)[key]
        load = os.getloadavg()[0]
        print(f"{name} (load {load:.2f}) ...", file=sys.stderr, flush=True)
        inputs = core.Inputs(shapes, device)
        results = run_shape(args.rows, inputs, args.warmup, args.rounds, args.start_limit)
        meta = {"device": core.device_name(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
                "rounds": args.rounds, "warmup": args.warmup, "load": load}
        texts.append(markdown(name, inputs, results, meta))
        out["shapes"][name] = {"meta": meta, "rows": results}
        _progress(texts[-1], out, args.json)  # a long run's finished tables are kept if a later one fails
        del inputs
    if args.startup:
        shapes_name = "gpt2-quick" if args.quick else "gpt2-small"
        startup = peer_startup.startup_rows(args.startup_rows, shapes_name, args.startup_timeout)
        texts.append(peer_startup.markdown(startup, peers.LABELS, shapes_name))
        out["startup"] = startup
        _progress(texts[-1], out, args.json)
    texts.append(f"load average after: {os.getloadavg()[0]:.2f}")
    print("\n\n".join(texts))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def _progress(table: str, out: dict, json_path) -> None:
    """A finished table to stderr at once, and the JSON so far."""
    print(table + "\n", file=sys.stderr, flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
