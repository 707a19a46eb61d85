"""Why a compiled kernel that updates a bf16 tensor in place next to an fp32 one is slow on the CPU.

Inductor's CPU code generator steps its loop by the lanes of a float vector (16 with AVX-512) as soon as one
node of the fused kernel is fp32 only (the copy back into an fp32 input counts), and then loads and stores a
bf16 tensor as masked half vectors; a kernel whose nodes all touch bf16 steps by a bf16 vector (32). Each case
below runs over fp32 ``p``, ``g`` and an ``m`` of each dtype, compiled, and prints the loop step inductor chose
(from the generated C++) with the median ms:

- ``m in place, alone``: ``m = m * 0.9 + g * 0.1`` (every node touches ``m``);
- ``m in place, p updated too``: the same and ``p -= 1e-3 * m`` (an fp32 node joins);
- ``m read only, p updated``: ``m`` only read;
- ``m written elsewhere, p updated``: ``m`` read, the new values stored in another tensor of its dtype.

    python perf/bench_lowp_tiling.py [--numel 16777216] [--rounds 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch


def in_place_alone(p, g, m, out):
    m.copy_((m.float() * 0.9 + g * 0.1).to(m.dtype))


def in_place_with_p(p, g, m, out):
    new = m.float() * 0.9 + g * 0.1
    p.sub_(1e-3 * new)
    m.copy_(new.to(m.dtype))


def read_only_with_p(p, g, m, out):
    p.sub_(1e-3 * (m.float() * 0.9 + g * 0.1))


def elsewhere_with_p(p, g, m, out):
    new = m.float() * 0.9 + g * 0.1
    p.sub_(1e-3 * new)
    out.copy_(new.to(out.dtype))


CASES = {"m in place, alone": in_place_alone, "m in place, p updated too": in_place_with_p,
         "m read only, p updated": read_only_with_p, "m written elsewhere, p updated": elsewhere_with_p}


def loop_step(fn, args) -> str:
    """The step of the generated C++ loop (``x0+=16``), read from inductor's output code."""
    from torch._inductor.utils import run_and_get_code
    _, codes = run_and_get_code(torch.compile(fn, dynamic=False), *args)
    steps = re.findall(r"x0\+=static_cast<int64_t>\((\d+)L\)", "\n".join(codes))
    return ",".join(sorted(set(steps))) or "?"


def median_ms(fn, args, rounds: int) -> float:
    compiled = torch.compile(fn, dynamic=False)
    for _ in range(3):
        compiled(*args)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        compiled(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = args.numel
    rows = {}
    for name, fn in CASES.items():
        for dtype in (torch.float32, torch.bfloat16):
            tensors = (torch.randn(n), torch.randn(n), torch.randn(n).to(dtype), torch.empty(n, dtype=dtype))
            rows[(name, str(dtype))] = (loop_step(fn, tensors), median_ms(fn, tensors, args.rounds))
    print(f"{n:,} elements, {args.threads} thread(s), torch {torch.__version__}; loop step, median ms")
    print(f"{'case':34} {'fp32 m':>16} {'bf16 m':>16}")
    for name in CASES:
        (s32, t32), (s16, t16) = rows[(name, "torch.float32")], rows[(name, "torch.bfloat16")]
        print(f"{name:34} {'x' + s32:>6} {t32:8.2f} ms {'x' + s16:>6} {t16:8.2f} ms")
    return rows


if __name__ == "__main__":
    main()
