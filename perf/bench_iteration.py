"""The whole iteration captured (graphstep.Iteration) versus the same iteration eager, interleaved in one process.

Per model: host time per iteration (median, p10, p90 of interleaved rounds: eager and captured take turns, so a
busy machine slows both alike), the captured / eager ratio, and the aten ops the captured graph replays per
iteration. On the CPU the replay backend runs those ops one by one from Python (its replay loop), so it saves the
Python of the forward (module calls, hooks, autograd's graph building) but not the kernels, and the backward,
which eagerly runs in autograd's C++ engine, costs one Python-dispatched call per op when replayed. On a GPU the
captured iteration is one graph launch (perf/gpu_check.py measures that).

    python perf/bench_iteration.py [--rounds 15] [--iterations 5] [--micro-batches 4] [--threads 1] [--json out.json]

Models: the demo's tiny GPT (graphstep.app.models.tiny, 4 micro-batches of 2 x 64 tokens), a narrow GPT whose
kernels are negligible (what remains is host overhead), and a stack of 5,000 Linear(8, 8) layers (10,000 tensors).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's graphstep, not an installed one
import torch  # noqa: E402

import graphstep as gs  # noqa: E402
from graphstep.app import models  # noqa: E402
from graphstep.iteration import Iteration  # noqa: E402


def gpt(config):
    def build():
        model = models.GPT(config, seed=0)
        corpus = models.SyntheticCorpus(config.vocab_size, seed=0)

        def batches(k):
            inputs, targets = corpus.batch(0, 2 * k, config.seq_len)
            return models.micro_batches(inputs, targets, k)

        return model, models.gpt_loss, batches
    return build


def linear_stack(layers=5000, width=8):
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def batches(k):
            return [torch.randn(2, width) for _ in range(k)]

        return model, lambda m, x: m(x).square().mean(), batches
    return build


MODELS = {
    "tiny GPT (0.9M params, 4 layers)": gpt(models.tiny()),
    "narrow GPT (d_model 16, seq 8)": gpt(models.tiny(d_model=16, d_ff=32, seq_len=8, n_heads=2)),
    "5,000 Linear(8, 8) (10,000 tensors)": linear_stack(),
}


def measure(build, k: int, rounds: int, iterations: int) -> dict:
    runs = {}
    for mode in ("eager", "graph"):
        model, loss_fn, batches = build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, clip_grad=1.0, kernel="fused", capture=mode), model)
        iteration = Iteration(model, opt, loss_fn, capture=mode, warmup=1)
        data = batches(k)
        for _ in range(3):  # warm-up and capture
            iteration(data)
        runs[mode] = (iteration, data, [])
    for _ in range(rounds):  # interleaved: eager and captured take turns
        for iteration, data, times in runs.values():
            started = time.perf_counter()
            for _ in range(iterations):
                iteration(data)
            times.append((time.perf_counter() - started) / iterations * 1e3)
    (entry,) = runs["graph"][0]._graphs.values()
    ops = len(entry.graph._backend._program.instrs) if entry.graph.backend == "replay" else None
    row = {mode: _summary(times) for mode, (_, _, times) in runs.items()}
    row["ratio"] = row["graph"]["median_ms"] / row["eager"]["median_ms"]
    row["replayed_ops"] = ops
    return row


def _summary(times: list) -> dict:
    ordered = sorted(times)
    return {"median_ms": statistics.median(times), "p10_ms": ordered[len(ordered) // 10],
            "p90_ms": ordered[min(len(ordered) - 1, (9 * len(ordered)) // 10)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iterations", type=int, default=5, help="iterations per timed round")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: the host cost, not parallelism)")
    parser.add_argument("--only", default=None, help="run the models whose name contains this")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = {}
    print(f"{'model':38s} {'eager ms':>9s} {'captured ms':>12s} {'ratio':>6s} {'replayed ops':>13s}")
    for name, build in MODELS.items():
        if args.only and args.only not in name:
            continue
        row = rows[name] = measure(build, args.micro_batches, args.rounds, args.iterations)
        print(f"{name:38s} {row['eager']['median_ms']:9.2f} {row['graph']['median_ms']:12.2f} {row['ratio']:6.2f} "
              f"{row['replayed_ops'] or '-':>13}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "threads": args.threads,
                                               "micro_batches": args.micro_batches, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
