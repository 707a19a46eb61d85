"""perf/gpu_check.py's CPU-offload part: the hybrid step on whatever device it is given.

- offload-eager-vs-captured: fraction 0.5, eager against captured, bitwise (params, state, flags);
- offload-vs-device-only: fraction 0.5 against no offload: bitwise on the CPU (both sides run the same
  fused kernel); on a GPU the host half runs the CPU kernel, so within 1e-2 of the distance moved
  (docs/design.md §8's measure), and every skip decision equal;
- offload-overlap: ``overlap_cpu_optimizer_d2h_h2d`` (worker thread; side stream and event waits on a GPU)
  against the plain offload, bitwise;
- offload-pinned-and-memory (GPU only): the host grad / main / staging buffers are pinned, the device's
  allocated bytes drop by at least the offloaded main params and state, and the replayed step (with its
  D2H copies inside the graph) runs under ``torch.cuda.set_sync_debug_mode("error")`` apart from the one
  explicit event wait.
"""

from __future__ import annotations

import torch

import graphstep as gs
from capture.devices import is_cuda, synchronize
from gpu_check_numerics import NO_CUDA, SMALL_STEPS, STEPS, close, record, tiny_model, train

HALF = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters())) and all(
        bool(torch.equal(x["update_successful"], y["update_successful"])) for x, y in zip(a.history, b.history))


def _drift(a, b, start) -> float:
    num = sum(((x.double() - y.double()) ** 2).sum() for x, y in zip(a, b))
    den = sum(((y.double() - s.double()) ** 2).sum() for y, s in zip(b, start))
    return float((num / den).sqrt())


def part_offload(device, small: bool) -> list[dict]:
    steps = SMALL_STEPS if small else STEPS
    out = []
    eager = train(device, "eager", precision="bf16", steps=steps, config_extra=HALF)
    captured = train(device, "graph", precision="bf16", steps=steps, config_extra=HALF)
    ok = _same(eager, captured) and captured.opt.captured
    out.append(record("offload-eager-vs-captured", "pass" if ok else "fail",
                      f"captured={captured.opt.captured}, backend={captured.opt.capture_backend}"))

    plain = train(device, "graph", precision="bf16", steps=steps)
    start = [p.detach().float() for p in tiny_model(device).parameters()]  # train's initial values
    flags_equal = all(bool(torch.equal(x["update_successful"], y["update_successful"]))
                      for x, y in zip(plain.history, captured.history))
    if is_cuda(device):
        drift = _drift([p.float() for p in captured.model.parameters()], [p.float() for p in plain.model.parameters()],
                       start)
        ok = flags_equal and drift < 1e-2
        out.append(record("offload-vs-device-only", "pass" if ok else "fail", f"drift {drift:.2e} of the motion",
                          drift=drift))
    else:
        ok = _same(plain, captured)
        out.append(record("offload-vs-device-only", "pass" if ok else "fail", "bitwise (both sides the CPU)"))

    overlapped = train(device, "graph", precision="bf16", steps=steps,
                       config_extra={**HALF, "overlap_cpu_optimizer_d2h_h2d": True})
    overlapped.opt.finish_param_gather()
    ok = _same(overlapped, captured)
    offload = overlapped.opt.build_record.offload
    out.append(record("offload-overlap", "pass" if ok else "fail",
                      f"{len(offload.chunks)} chunks, {offload.waited_chunks} waited"))

    if not is_cuda(device):
        out.append(record("offload-pinned-and-memory", NO_CUDA))
    else:
        out.append(_pinned_and_memory(device))
    for run in (eager, captured, plain, overlapped):
        close(run.opt)
    return out


def _pinned_and_memory(device) -> dict:
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    base = gs.get_optimizer(gs.OptimizerConfig(bf16=True, capture="graph"), tiny_model(device))
    base_bytes = torch.cuda.memory_allocated(device) - before
    before = torch.cuda.memory_allocated(device)
    opt = gs.get_optimizer(gs.OptimizerConfig(bf16=True, capture="graph", **HALF), tiny_model(device))
    offload_bytes = torch.cuda.memory_allocated(device) - before
    host = opt.host_tensors
    pinned = all(t.is_pinned() for kind in ("grads", "main_params", "param_staging") for t in host[kind] if t.numel())
    host_optimizer = sum(t.numel() * t.element_size() for kind in ("main_params", "exp_avg", "exp_avg_sq")
                         for t in host[kind])
    saved = base_bytes - offload_bytes
    # A few captured replays under sync debug mode: a hidden host sync in the device step would raise.
    model = opt.buffers.params
    error = ""
    try:
        for step in range(6):
            for p in model:
                p.main_grad.fill_(1e-3 * (step + 1))
            if step == 5:
                torch.cuda.set_sync_debug_mode("error")
            opt.step()
    except RuntimeError as exc:
        error = str(exc)[:200]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ok = pinned and saved >= host_optimizer * 0.9 and not error
    return record("offload-pinned-and-memory", "pass" if ok else "fail",
                  f"pinned={pinned}, device bytes saved {saved} vs host optimizer bytes {host_optimizer}; {error}",
                  saved=saved, host_optimizer_bytes=host_optimizer)
