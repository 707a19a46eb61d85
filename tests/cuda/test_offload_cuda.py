"""Hybrid CPU offload on a GPU (skipped without an NVIDIA GPU): pinned host buffers, the D2H copies inside
the CUDA graph, the one event wait, side-stream H2D chunks with event waits, and the device memory saved.

On a GPU the host half runs torch's fused CPU kernel and the device half the CUDA one, so a run with
offload is compared with one without by docs/design.md §8's drift (and equal skip decisions); eager against
captured, and overlapped against plain offload, run the same kernels on the same data: bitwise.
"""

import pytest
import torch

import capture
import graphstep as gs
from graphstep.step.stages import chain
from _bitwise import assert_state_equal
from _training import PRECISIONS, tiny_model, train

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")]

HALF = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}
INF_STEP = 11


def run(mode, precision="bf16", steps=25, **offload):
    """The shared run; its skip decisions as bools."""
    model, opt, reported = train(mode, precision, steps=steps, inf_step=INF_STEP, **offload)
    return model, opt, [bool(update_successful) for update_successful, _, _ in reported]


def test_host_buffers_are_pinned_and_the_device_keeps_only_its_part():
    model = tiny_model()
    opt = gs.get_optimizer(gs.OptimizerConfig(bf16=True, **HALF), model)
    host = opt.host_tensors
    for kind in ("grads", "main_params", "param_staging"):
        assert all(t.is_pinned() for t in host[kind] if t.numel()), kind
    # The scalars the device step copies out (step, grad_scale, found_inf) are pinned; the host hyperparameter
    # table is written and read on the host only (graphstep/offload/host.py) and is not.
    *copied_from_device, host_hyper = host["scalars"]
    assert all(t.is_pinned() for t in copied_from_device) and not host_hyper.is_pinned()
    assert all(t.device.type == "cpu" for ts in host.values() for t in ts)
    device_state = sum(t.numel() for ts in opt.buffers.state.values() for t in ts)
    host_state = sum(t.numel() for name in opt.buffers.state for t in host[name])
    assert 0 < device_state and 0 < host_state
    assert all(t.device.type == "cuda" for ts in opt.buffers.state.values() for t in ts)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_captured_offload_step_is_bitwise_equal_to_eager(precision):
    eager, captured = run("eager", precision, **HALF), run("graph", precision, **HALF)
    assert captured[1].captured and captured[1].recaptures == 0
    assert eager[2] == captured[2] and not eager[2][INF_STEP]
    for p, q in zip(eager[0].parameters(), captured[0].parameters()):
        assert torch.equal(p, q)
    assert_state_equal(eager[1], captured[1])


def test_offload_matches_the_device_only_step_within_the_motion():
    base, half = run("graph"), run("graph", **HALF)
    assert base[2] == half[2]
    start = [p.detach().float() for p in tiny_model().parameters()]
    num = sum(((a.float() - b.float()) ** 2).sum() for a, b in zip(half[0].parameters(), base[0].parameters()))
    den = sum(((b.float() - s) ** 2).sum() for b, s in zip(base[0].parameters(), start))
    assert float((num / den).sqrt()) < 1e-2


def test_overlapped_chunks_on_side_streams_match_plain_offload_bitwise():
    plain = run("graph", **HALF)
    overlapped = run("graph", **HALF, overlap_cpu_optimizer_d2h_h2d=True)
    assert len(overlapped[1].build_record.offload.chunks) > 1
    for p, q in zip(plain[0].parameters(), overlapped[0].parameters()):
        assert torch.equal(p, q)
    assert_state_equal(plain[1], overlapped[1])


def test_auto_captures_the_offloaded_step_its_d2h_copies_are_capture_safe():
    model = tiny_model()
    opt = gs.get_optimizer(gs.OptimizerConfig(bf16=True, capture="auto", capture_warmup_steps=1, **HALF), model)
    findings = capture.check(chain(opt.stages))  # the step the runner captures: its stages, chained
    assert findings == [], findings  # non_blocking D2H into pinned memory is recorded, not a host sync
    for _ in range(4):
        for p in model.parameters():
            p.main_grad.fill_(1e-3)
        opt.step()
    assert opt.captured


def test_the_replayed_step_has_no_hidden_host_sync():
    model, opt, _ = run("graph", steps=6, **HALF)
    for p in model.parameters():
        p.main_grad.fill_(1e-3)
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.build_record.runner.run()  # the captured device step alone: D2H copies included, no sync
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_device_memory_drops_by_the_offloaded_optimizer_bytes():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    base = gs.get_optimizer(gs.OptimizerConfig(bf16=True, capture="eager"), tiny_model())
    base_bytes = torch.cuda.memory_allocated() - before
    before = torch.cuda.memory_allocated()
    opt = gs.get_optimizer(gs.OptimizerConfig(bf16=True, capture="eager", optimizer_cpu_offload=True,
                                              optimizer_offload_fraction=1.0), tiny_model())
    offload_bytes = torch.cuda.memory_allocated() - before
    host = opt.host_tensors
    moved = sum(t.numel() * t.element_size() for kind in ("main_params", "exp_avg", "exp_avg_sq") for t in host[kind])
    assert base_bytes - offload_bytes >= 0.9 * moved
    assert sum(t.numel() for t in opt.buffers.main_shard) == 0
    del base
