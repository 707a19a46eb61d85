"""Host work per step as the number of params grows: ops and milliseconds per step at 150, 1,000 and
10,000 params of 64 elements each (so small that the step's arithmetic is negligible and its time is the
host's: Python, dispatch, guards), graphstep's default step against torch's ``clip_grad_norm_`` +
``AdamW(fused=True)`` over the same params, interleaved in one run per count.

graphstep's grads arrive through the backward stand-in (``bench_core.backward_stand_in``, untimed before
each step), so the step sees what it sees after a real backward; two more rows copy them in, as torch's row
does, by default and with ``param_checks="on_request"`` (the per-param reads off after the first step). Ops
are the aten ops one step dispatches.
Then, for an FSDP2 model of the same params (``fully_shard`` on a one-rank gloo mesh), what its per-param
checks cost: FSDP2's binding check (graphstep/fsdp2/bindings.py) and the ``requires_grad`` watch, timed alone.
Every check row is timed with the compiled loops (graphstep/native, built first if need be) and in Python, cold
(right after the refill, as in the step) and warm (right after the same checks ran once more, untimed).

    python perf/bench_host.py [--rounds 200] [--counts 150,1000,10000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's graphstep, not an installed one
import torch  # noqa: E402

from graphstep.app import bench_core as core  # noqa: E402
from graphstep.app import bench_shapes  # noqa: E402
from graphstep.native import build  # noqa: E402

NUMEL = 64


def run(count: int, rounds: int) -> list[dict]:
    inputs = core.Inputs(bench_shapes.many_tensors(count, NUMEL), torch.device("cpu"))
    graphstep = core.build_graphstep(inputs, kernel=None, fold=True)
    buffers = [domain.buffers for domain in graphstep.optimizer.domains]
    requires_grad = graphstep.optimizer.build_record.requires_grad  # the step's own watch, timed as the step runs it

    def per_param_checks() -> bool:
        requires_grad.check()
        return all(b.bindings_intact() for b in buffers)

    pipelines = {"graphstep": graphstep,
                 # The grads copied in, as torch's row refills them: no backward stand-in, whose freed autograd
                 # objects glibc's malloc sorts at the next larger allocation, the step's (docs/performance.md,
                 # host time per step); then the same with the per-param reads off between requests.
                 "graphstep-copied": core.build_graphstep(inputs, kernel=None, fold=True, timed="step-after-copy"),
                 "graphstep-on-request-copied": core.build_graphstep(inputs, kernel=None, fold=True,
                                                                     timed="step-after-copy",
                                                                     param_checks="on_request"),
                 # The parts of the step that walk every param (see the README), the binding guard and the
                 # requires_grad watch: timed on their own, after the same refill, to show what the rest of
                 # the host work costs; then the same checks, and the whole step, with the checks in Python.
                 "guard": core.Pipeline(per_param_checks, graphstep.refill),
                 "guard-python": core.Pipeline(_in_python(per_param_checks), graphstep.refill),
                 # Warm: the same checks, run once more untimed right before, so the params' objects are in
                 # cache (as where the host does not stream the buffers: a GPU's).
                 "guard-warm": core.Pipeline(per_param_checks, _then(graphstep.refill, per_param_checks)),
                 "guard-python-warm": core.Pipeline(_in_python(per_param_checks),
                                                    _then(graphstep.refill, _in_python(per_param_checks))),
                 "graphstep-python": core.Pipeline(_in_python(graphstep.step), graphstep.refill),
                 "torch": core.build_torch_adamw(inputs, fused=True, clip=True)}
    ops = {key: core.count_ops(p)[0] for key, p in pipelines.items() if key in ("graphstep", "torch")}
    times = core.time_interleaved({k: p.step for k, p in pipelines.items()}, inputs.device, warmup=5,
                                  rounds=rounds, before={k: p.refill for k, p in pipelines.items() if p.refill})
    kernel = pipelines["graphstep"].optimizer.kernel_choice.name
    rows = [{"params": count, "row": key, "ops": ops.get(key), "ms": statistics.median(times[key]),
             "kernel": kernel if key != "torch" else "fused"} for key in pipelines]
    core.free_memory(inputs.device)
    return rows


def fsdp2_checks(count: int, rounds: int) -> list[dict]:
    """ms of an FSDP2 engine's per-param checks over ``count`` params, compiled and in Python (the process group
    is made by the caller)."""
    from torch.distributed.fsdp import fully_shard

    import graphstep as gs
    inputs = core.Inputs(bench_shapes.many_tensors(count, NUMEL), torch.device("cpu"))
    model = fully_shard(inputs.module(inputs.new_params()))
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, kernel="fused", capture="eager"), model)
    record = opt.build_record

    def checks() -> None:
        record.shard_bindings.check()
        record.requires_grad.check()

    times = core.time_interleaved({"native": checks, "python": _in_python(checks)}, inputs.device, warmup=5,
                                  rounds=rounds)
    return [{"params": count, "row": "fsdp2-checks" + ("" if way == "native" else "-python"),
             "ms": statistics.median(times[way])} for way in ("native", "python")]


def _then(*fns):
    def run():
        for fn in fns:
            fn()
    return run


def _in_python(fn):
    """``fn`` with graphstep's per-param checks in Python (graphstep/native/build.py: as without a compiler)."""
    def run(*args):
        with build.python_only():
            return fn(*args)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--counts", default="150,1000,10000")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if build.wait(timeout=600) is None:
        print(f"the native checks are not built ({build.status()}): both columns time the Python checks")
    rows = [row for count in map(int, args.counts.split(",")) for row in run(count, args.rounds)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} interleaved rounds, "
          f"params of {NUMEL} elements; checks: {build.status()}")
    print("| params | graphstep ops/step | graphstep ms/step | grads copied in: ms/step | and "
          "param_checks='on_request' | per-param checks, ms | ns a param | warm, ns a param | "
          "checks in Python: step ms | checks ms | ns a param | warm, ns a param | "
          "torch clip_grad_norm_ + AdamW(fused) ops/step | torch ms/step (grads copied in) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for count in sorted({r["params"] for r in rows}):
        g, gc, go, b, bw, gp, bp, bpw, t = (
            next(r for r in rows if r["params"] == count and r["row"] == key)
            for key in ("graphstep", "graphstep-copied", "graphstep-on-request-copied", "guard", "guard-warm",
                        "graphstep-python", "guard-python", "guard-python-warm", "torch"))
        per_param = {key: row["ms"] * 1e6 / count for key, row in (("b", b), ("bw", bw), ("bp", bp), ("bpw", bpw))}
        print(f"| {count:,} | {g['ops']} | {g['ms']:.3f} | {gc['ms']:.3f} | {go['ms']:.3f} | {b['ms']:.3f} | "
              f"{per_param['b']:.0f} | {per_param['bw']:.0f} | {gp['ms']:.3f} | {bp['ms']:.3f} | "
              f"{per_param['bp']:.0f} | {per_param['bpw']:.0f} | {t['ops']} | {t['ms']:.3f} |")
    fsdp2 = _with_one_rank_group(lambda: [row for count in map(int, args.counts.split(","))
                                          for row in fsdp2_checks(count, args.rounds)])
    print("\n| params | FSDP2: the binding check and the requires_grad watch, ms | ns a param | in Python, ms | "
          "ns a param |")
    print("|---:|---:|---:|---:|---:|")
    for count in sorted({r["params"] for r in fsdp2}):
        native, python = (next(r for r in fsdp2 if r["params"] == count and r["row"] == key)
                          for key in ("fsdp2-checks", "fsdp2-checks-python"))
        print(f"| {count:,} | {native['ms']:.3f} | {native['ms'] * 1e6 / count:.0f} | {python['ms']:.3f} | "
              f"{python['ms'] * 1e6 / count:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows + fsdp2, indent=1))
    return 0


def _with_one_rank_group(fn):
    """``fn()`` inside a one-rank gloo process group on 127.0.0.1 (FSDP2 needs one)."""
    import os

    import torch.distributed as dist

    from graphstep.app.demo_dist import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        return fn()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
