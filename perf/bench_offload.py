"""Hybrid CPU offload: step time and bytes per param at offload fractions 0 / 0.5 / 1.0.

    python perf/bench_offload.py [--shapes gpt2-small|gpt2-quick] [--rounds 2] [--steps 3] [--json out.json]

GPT-2-small shapes (124M params, 148 tensors) in bf16 with fp32 main params and Adam, clipping on, the
grads filled once (no backward: the step is what is measured). The fractions run interleaved, round by
round (one optimizer alive at a time: three of them would not fit next to the other jobs of a 23 GB
machine), and each row reports the median step time over its rounds. Per param: the bytes the device
holds (params, grads, main params, state: each storage once) and the host holds (offload's buffers), and
the bytes that cross between them per step (D2H fp32 grads + H2D bf16 params of the offloaded part).

On a CPU-only machine both "sides" are the CPU: the rows then show the cost of the offload machinery
(the D2H/H2D copies become memory copies), not PCIe; the bytes are what they would be on a GPU.
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
from capture.devices import synchronize  # noqa: E402
from graphstep.app.bench_shapes import SETS  # noqa: E402

FRACTIONS = (0.0, 0.5, 1.0)


class Params(torch.nn.Module):
    def __init__(self, shapes, device):
        super().__init__()
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(shape, device=device) * 0.02) for _, shape in shapes)


def _storages(tensors) -> dict:
    return {(t.device.type, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in tensors}


def device_bytes(opt) -> int:
    b = opt.buffers
    return sum(_storages([*b.param_flat, *b.grad_flat, *b.grad_shard, *b.main_shard,
                          *(t for ts in b.state.values() for t in ts)]).values())


def host_bytes(opt) -> int:
    return sum(_storages([t for ts in opt.host_tensors.values() for t in ts]).values())


def build(shapes, fraction: float, device):
    torch.manual_seed(0)
    model = Params(shapes, device)
    offload = {} if fraction == 0 else {"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction}
    opt = gs.get_optimizer(gs.OptimizerConfig(optimizer="adam", bf16=True, clip_grad=1.0, capture="auto", **offload),
                           model)
    generator = torch.Generator(device=device).manual_seed(1)
    for p in model.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=generator, device=device) * 1e-3)
    return model, opt


def time_steps(opt, steps: int, device) -> list[float]:
    times = []
    for _ in range(steps + 1):  # the first step warms up (and, on a GPU, captures)
        synchronize(device)
        start = time.perf_counter()
        opt.step()
        opt.finish_param_gather()  # an overlapped host part counts too
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times[1:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="gpt2-small", choices=sorted(SETS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    shapes = SETS[args.shapes]()
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    warnings.filterwarnings("ignore", message="graphstep: step\\(\\) ran before any backward")
    rows = {f: {"fraction": f, "times_s": []} for f in FRACTIONS}
    for _ in range(args.rounds):
        for fraction in FRACTIONS:
            model, opt = build(shapes, fraction, device)
            row = rows[fraction]
            row["times_s"] += time_steps(opt, args.steps, device)
            offloaded = sum(t.numel() for t in opt.host_tensors.get("main_params", []))  # host elements
            row.update(device_bytes_per_param=device_bytes(opt) / numel, host_bytes_per_param=host_bytes(opt) / numel,
                       offloaded_params=offloaded, copy_bytes_per_step=offloaded * (4 + 2))
            opt.close()
            del model, opt
    print(f"{args.shapes}: {numel / 1e6:.1f}M params, bf16 + fp32 main params, Adam, device {device.type}"
          + (" (a CPU-only machine: both sides are the CPU)" if device.type == "cpu" else ""))
    print(f"{'fraction':>8} {'step ms':>9} {'device B/param':>15} {'host B/param':>13} {'D2H+H2D MB/step':>16}")
    for row in rows.values():
        row["median_ms"] = 1e3 * statistics.median(row["times_s"])
        print(f"{row['fraction']:>8.1f} {row['median_ms']:>9.1f} {row['device_bytes_per_param']:>15.2f} "
              f"{row['host_bytes_per_param']:>13.2f} {row['copy_bytes_per_step'] / 1e6:>16.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shapes": args.shapes, "device": device.type, "numel": numel,
                                               "rows": list(rows.values())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
