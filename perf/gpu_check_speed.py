"""perf/gpu_check.py's speed parts: kernels per replay, captured vs eager, the bandwidth floor, host time.

The pipelines and timers are graphstep/app/bench_core.py's (the same ones ``graphstep bench`` and
perf/harness.py time). On the CPU (the dry run) the sizes shrink, kernels are counted as dispatched aten
ops (what the replay backend replays), and the GPU goals are recorded as ``skipped: no CUDA``.
"""

from __future__ import annotations

import statistics
import time

import torch

from capture.devices import is_cuda, synchronize
from graphstep.app import bench_core as core
from graphstep.app import bench_shapes, bench_stats
from gpu_check_numerics import NO_CUDA, record

TENSOR_COUNTS = (150, 1_000, 10_000)
SMALL_TENSOR_COUNTS = (15, 100, 1_000)  # the dry run: the same sweep, a tenth of the tensors
# Both goals compare runs that move the same bytes (docs/design.md §6), so a ratio above 1 is overhead:
# the captured step over 10,000 small tensors against the same step over one flat tensor of the same size
# (the buckets are the same flat buffers: only the per-tensor views differ), and the flat step against its
# bytes at the measured stream bandwidth.
SAME_BYTES_GOAL, FLOOR_GOAL = 1.15, 1.15


def _sizes(small: bool) -> dict:
    return {"sweep_total": 1_000 * 128 if small else 16 * 2**20,   # same total at every tensor count
            "many_small_numel": 64 if small else 256,             # elements per tensor
            "many_small_count": 1_000 if small else 10_000,
            "flat": 64 * 2**20, "stream": 256 * 2**20}          # the flat step and the HBM stream (GPU only)


def kernels_per_replay(pipeline: core.Pipeline, device, replays: int = 5) -> tuple[float, str]:
    """Kernels one replay launches (torch.profiler's device activities, memcpy/memset excluded) on a GPU;
    on the CPU, the aten ops one replay dispatches."""
    if not is_cuda(device):
        count, note = core.count_ops(pipeline)
        return (float("nan") if count is None else float(count)), note or "aten ops dispatched per replay"
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            pipeline.step()
        synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    return len(kernels) / replays, "CUDA kernels per replay (torch.profiler)"


def part_kernels(device, small: bool) -> list[dict]:
    """Kernels per replay at 150 / 1,000 / 10,000 tensors of the same total size: equal counts expected
    (the captured step's work follows the buckets, not the params)."""
    total = _sizes(small)["sweep_total"]
    counts, how = {}, ""
    for tensors in SMALL_TENSOR_COUNTS if small else TENSOR_COUNTS:
        inputs = core.Inputs(bench_shapes.many_tensors(tensors, total // tensors, cols=64), device)
        pipeline = core.build_graphstep(inputs, capture="graph")
        counts[tensors], how = kernels_per_replay(pipeline, device)
        pipeline = None
        core.free_memory(device)
    return [kernel_count_verdict(counts, how, total), planted_kernel_control(device)]


def planted_kernel_control(device) -> dict:
    """The kernel count can see a change: a captured step of three element-wise ops, and the same step with
    one more planted in it, counted the same way as the rows above; the planted one must count exactly one
    kernel more per replay, and the plain one a non-zero number."""
    import capture

    x = torch.zeros(1 << 12, device=device)

    def step(planted: bool):
        def run():
            x.mul_(0.5)
            x.add_(1.0)
            x.sqrt_()
            if planted:
                x.add_(1.0)  # the planted kernel
        return run

    counts = {}
    for planted in (False, True):
        graph = capture.graph(step(planted), warmup=1, device=device)
        for _ in range(3):  # warm-up, capture, one replay: what follows are replays
            graph()
        counts[planted], how = kernels_per_replay(core.Pipeline(graph), device)
        graph.close()
    plain, planted = counts[False], counts[True]
    return planted_verdict(plain, planted, how)


def planted_verdict(plain: float, planted: float, how: str) -> dict:
    ok = plain > 0 and planted - plain == 1
    return record("kernels-negative-control", "pass" if ok else "fail",
                  f"a captured step of 3 element-wise ops: {plain:g}, with one planted: {planted:g} ({how}; "
                  f"expected exactly one more, and not zero)", plain=plain, planted=planted)


def kernel_count_verdict(counts: dict, how: str, total: int) -> dict:
    """The kernel-count row: the same non-zero count at every tensor count. Zero is what a profiler that records
    no kernel inside a graph replay reports: equal, and meaningless."""
    values = list(counts.values())
    ok = all(v == values[0] for v in values) and values[0] > 0  # equal, counted (a NaN is not > 0)
    detail = ", ".join(f"{v:g} at {t} tensors" for t, v in counts.items()) + f" ({how}, ~{total / 1e6:.2f}M params)"
    return record("kernels-per-replay-independent-of-tensor-count", "pass" if ok else "fail", detail,
                  per_tensor_count={str(t): v for t, v in counts.items()})


def unmeasured(values: dict) -> list[str]:
    """The names whose measurement is not a positive number: a timer or counter that recorded nothing makes
    its row fail, never pass (nor divide by zero)."""
    return [name for name, value in values.items() if not value > 0]


def _nothing_measured(name: str, missing: list[str], **numbers) -> dict:
    return record(name, "fail", f"measured nothing for {', '.join(missing)} (zero or NaN)", **numbers)


def host_ms(step, steps: int = 50) -> float:
    """Median host (CPU) time of one call, without waiting for the device: what a replay costs the CPU."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def part_speed(device, small: bool) -> list[dict]:
    """The captured step at 10,000 small tensors against one flat tensor of the same size (goal <= 1.15x),
    eager and host time per call (reported), and the flat 64M step against its bytes at the measured HBM
    bandwidth (goal <= 1.15x)."""
    sizes = _sizes(small)
    steps, count = (5 if small else 50), sizes["many_small_count"]
    numel = count * sizes["many_small_numel"]
    many = core.Inputs(bench_shapes.many_tensors(count, sizes["many_small_numel"], cols=64), device)
    flat = core.Inputs(bench_shapes.flat_tensor(numel), device)
    pipelines = {"eager": core.build_graphstep(many, capture="eager"),
                 "captured": core.build_graphstep(many, capture="graph"),
                 "captured-flat": core.build_graphstep(flat, capture="graph")}
    times = core.time_interleaved({k: p.step for k, p in pipelines.items()}, device, 3, steps,
                                  before={k: p.refill for k, p in pipelines.items()})
    ms = {k: statistics.median(v) for k, v in times.items()}
    host = {k: host_ms(pipelines[k].step, steps) for k in ("eager", "captured")}
    synchronize(device)
    numbers = {**{f"{k}_ms": v for k, v in ms.items()}, "tensors": count, "numel": many.numel}
    missing = unmeasured({**ms, **{f"{k} host": v for k, v in host.items()}})
    if missing:
        pipelines = many = flat = None
        return [_nothing_measured(n, missing, **numbers) for n in ("captured-10k-tensors-vs-flat",
                                                                   "cpu-time-per-replay", "flat-64M-vs-hbm-floor")]
    out = []
    ratio = ms["captured"] / ms["captured-flat"]
    detail = (f"captured over {count:,} x {sizes['many_small_numel']} params {ms['captured']:.3f} ms / over one flat "
              f"tensor of {numel} {ms['captured-flat']:.3f} ms = {ratio:.2f}x (same bytes; goal <= "
              f"{SAME_BYTES_GOAL}x); eager {ms['eager']:.3f} ms")
    if is_cuda(device):
        out.append(record("captured-10k-tensors-vs-flat", "pass" if ratio <= SAME_BYTES_GOAL else "fail", detail,
                          **numbers))
    else:
        out.append(record("captured-10k-tensors-vs-flat", NO_CUDA, f"CPU replay for reference: {detail}", **numbers))
    out.append(record("cpu-time-per-replay", "pass",
                      f"host time per call: replay {host['captured'] * 1e3:.0f} us, eager step "
                      f"{host['eager'] * 1e3:.0f} us "
                      f"(informational; on a GPU the replay returns before its kernels finish)",
                      replay_host_us=host["captured"] * 1e3, eager_host_us=host["eager"] * 1e3))
    pipelines = many = flat = None
    core.free_memory(device)
    out.append(flat_vs_floor(device, sizes) if is_cuda(device) else record("flat-64M-vs-hbm-floor", NO_CUDA))
    return out


def flat_vs_floor(device, sizes: dict) -> dict:
    """The captured full step over one flat 64M-param tensor against the bytes its kernel moves at the
    stream bandwidth: 32 B/param (the compiled kernel), 36 with a fused one given a grad scale, which writes
    the grads back (graphstep/kernels/__init__.py)."""
    stream = core.build_stream(sizes["stream"], device)
    stream_ms = statistics.median(core.time_steps(stream.step, device, 3, 20))
    stream = None
    core.free_memory(device)
    inputs = core.Inputs(bench_shapes.flat_tensor(sizes["flat"]), device)
    pipeline = core.build_graphstep(inputs, capture="graph")
    step_ms = statistics.median(core.time_steps(pipeline.step, device, 3, 20, before=pipeline.refill))
    kernel = pipeline.optimizer.kernel_choice.name
    step_bytes = core.step_bytes(kernel, scaled=core.CLIP > 0)
    missing = unmeasured({"stream": stream_ms, "step": step_ms})
    if missing:
        return _nothing_measured("flat-64M-vs-hbm-floor", missing)
    bandwidth = core.STREAM_BYTES * sizes["stream"] / (stream_ms * 1e-3)
    floor_ms = step_bytes * inputs.numel / bandwidth * 1e3
    ratio = step_ms / floor_ms
    return record("flat-64M-vs-hbm-floor", "pass" if ratio <= FLOOR_GOAL else "fail",
                  f"captured step ({kernel} kernel) {step_ms:.3f} ms vs floor {floor_ms:.3f} ms ({step_bytes} B x "
                  f"{inputs.numel / 1e6:.1f}M at the measured {bandwidth / 1e9:.0f} GB/s) = {ratio:.2f}x "
                  f"(goal <= {FLOOR_GOAL}x)", step_ms=step_ms, floor_ms=floor_ms, stream_gbps=bandwidth / 1e9,
                  bytes_per_param=step_bytes)


# On a GPU at GPT-2 small every row is bandwidth-bound, so each goal is a byte ratio times a slack, stated
# with its bytes. graphstep's folded step moves step_bytes(kernel) less the norm's read (folded into
# backward): 28 B/param with the compiled kernel, 32 with the fused one (it writes the grads back).
FOLD_STEP_SLACK = 1.05  # the folded step within 5% of its bytes' share of the bare update's time
PEER_SLACK = 0.9  # a torch peer's extra bytes show as at least 90% of the byte ratio
PEER_BYTES = {"torch-amp": core.TORCH_AMP_BYTES, "adamw-fused-clip": core.CLIP_ADAMW_BYTES}
PEER_NAMES = {"torch-amp": "GradScaler.unscale_ + clip_grad_norm_ + AdamW(fused) + update",
              "adamw-fused-clip": "clip_grad_norm_ + AdamW(fused=True)"}


def part_fold(device, small: bool) -> list[dict]:
    """``fold_grad_norm`` (the default) on the device, GPT-2 small's shapes, captured, the default kernel
    (compiled with Triton: it reads the grads without writing them back), one interleaved run: the folded
    step against one flat ``_fused_adamw_`` (goal <= 1.05x), the backward stand-in + step with the fold
    against without it (goal: faster), and the torch peers against the folded step (goals from their bytes).
    The CPU dry run: a 2-layer GPT-2 shape and the fused kernel (no compile), for reference."""
    shapes = bench_shapes.gpt2(n_layer=2, d_model=128, vocab=1024, n_ctx=128) if small else bench_shapes.gpt2_small()
    inputs = core.Inputs(shapes, device)
    scaled = dict(loss_scale=core.LOSS_SCALE, capture="graph", kernel="fused" if small else None)
    pipelines = {"floor": core.build_fused_floor(inputs),
                 "step": core.build_graphstep(inputs, **scaled),
                 "step-folded": core.build_graphstep(inputs, fold=True, **scaled),
                 "backward-step": core.build_graphstep(inputs, timed="backward+step", **scaled),
                 "backward-step-folded": core.build_graphstep(inputs, fold=True, timed="backward+step", **scaled),
                 "torch-amp": core.build_torch_amp(inputs),
                 "adamw-fused-clip": core.build_torch_adamw(inputs, fused=True, clip=True)}
    warmup, rounds = (1, 3) if small else (3, 30)
    times = core.time_interleaved({k: p.step for k, p in pipelines.items()}, device, warmup, rounds,
                                  before={k: p.refill for k, p in pipelines.items() if p.refill is not None})
    ms = {k: statistics.median(v) for k, v in times.items()}
    kernel = pipelines["step-folded"].optimizer.kernel_choice.name
    ours = core.step_bytes(kernel, scaled=True) - core.NORM_BYTES
    pipelines = inputs = None
    core.free_memory(device)
    missing = unmeasured(ms)
    if missing:
        return [_nothing_measured(n, missing) for n in ("fold-step-vs-fused-floor", "fold-backward-plus-step",
                                                         *(f"default-step-vs-{peer}" for peer in PEER_BYTES))]

    def ratio(numerator: str, denominator: str) -> tuple[float, str]:
        """The ratio of the two rows' medians, and its 95% bootstrap interval over the rounds in words."""
        value, low, high = bench_stats.ratio_interval(times[numerator], times[denominator])
        return value, f"[95% interval {low:.2f}-{high:.2f}]"

    step_ratio, step_interval = ratio("step-folded", "floor")
    whole_ratio, whole_interval = ratio("backward-step-folded", "backward-step")
    numbers = {**{f"{k}_ms": v for k, v in ms.items()}, "kernel": kernel, "step_bytes_per_param": ours}
    fold_goal = FOLD_STEP_SLACK * ours / core.ADAM_BYTES
    step_detail = (f"folded step ({kernel} kernel, {ours} B/param) {ms['step-folded']:.3f} ms / _fused_adamw_ "
                   f"({core.ADAM_BYTES} B/param) {ms['floor']:.3f} ms = {step_ratio:.2f}x {step_interval} (unfolded "
                   f"{ms['step'] / ms['floor']:.2f}x; goal <= {FOLD_STEP_SLACK} x {ours}/{core.ADAM_BYTES} = "
                   f"{fold_goal:.2f}x)")
    whole_detail = (f"backward stand-in + folded step {ms['backward-step-folded']:.3f} ms / + unfolded step "
                    f"{ms['backward-step']:.3f} ms = {whole_ratio:.2f}x {whole_interval} (goal < 1)")
    checks = [("fold-step-vs-fused-floor", step_ratio <= fold_goal, step_detail),
              ("fold-backward-plus-step", whole_ratio < 1.0, whole_detail)]
    for peer, peer_bytes in PEER_BYTES.items():
        speedup, interval = ratio(peer, "step-folded")
        goal = PEER_SLACK * peer_bytes / ours
        checks.append((f"default-step-vs-{peer}", speedup >= goal,
                       f"torch {PEER_NAMES[peer]} ({peer_bytes} B/param) {ms[peer]:.3f} ms / graphstep's default "
                       f"step ({ours} B/param) {ms['step-folded']:.3f} ms = {speedup:.2f}x faster {interval} "
                       f"(goal >= {PEER_SLACK} x {peer_bytes}/{ours} = {goal:.2f}x)"))
    if not is_cuda(device):
        return [record(name, NO_CUDA, "CPU for reference: " + detail, **numbers) for name, _, detail in checks]
    return [record(name, "pass" if ok else "fail", detail, **numbers) for name, ok, detail in checks]
