"""``opt.memory_stats()`` on one process: kinds, aliases counted once, host tensors, fp8 scales, no pool.

The multi-rank accounting (ZeRO's formula per rank) is tests/distributed/test_memory_stats.py.
"""

import pytest
import torch

from graphstep import fp8
from _engine import make_engine
from toy import loss_fn, tiny_transformer


def build(model=None, **config):
    model = tiny_transformer() if model is None else model
    return model, make_engine(model, **config)


def storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_fp32_adam_counts_the_params_once_as_the_main_params():
    _, opt = build(optimizer="adam")
    device = opt.memory_stats()["device"]
    padded = sum(buf.numel for buf in opt.layout.buffers)
    assert device["params"] == device["grads"] == 4 * padded
    assert device["main_params"] == 0  # the fp32 params are the main params: counted under "params"
    assert device["exp_avg"] == device["exp_avg_sq"] == 4 * padded
    assert device["comm_scratch"] == 0
    assert device["total"] == sum(v for k, v in device.items() if k != "total")
    assert "graph_pool" not in device and "fp8_scales" not in device


def test_bf16_sgd_keeps_fp32_main_params_and_momentum_and_agrees_with_the_storages():
    _, opt = build(optimizer="sgd", sgd_momentum=0.9, bf16=True)
    device = opt.memory_stats()["device"]
    padded = sum(buf.numel for buf in opt.layout.buffers)
    assert device["params"] == 2 * padded and device["grads"] == 4 * padded  # fp32 main grads
    assert device["main_params"] == device["momentum_buffer"] == 4 * padded
    b = opt.buffers
    walked = storage_bytes([*b.param_flat, *b.grad_flat, *b.main_shard, *b.grad_shard,
                            *[t for ts in b.state.values() for t in ts]])
    assert device["total"] - device["scalars"] == walked


def test_half_grads_under_fp32_main_params_report_the_cast_scratch():
    _, opt = build(optimizer="adam", bf16=True, main_grads_dtype=torch.bfloat16)
    device = opt.memory_stats()["device"]
    padded = sum(buf.numel for buf in opt.layout.buffers)
    assert device["grads"] == 2 * padded
    assert device["grad_cast"] == 4 * padded  # the kernel reads fp32 grads: one fp32 copy of the shard


def test_host_tensors_count_under_host_only():
    _, opt = build(optimizer="adam")
    moved = opt.buffers.state["exp_avg"]
    before = opt.memory_stats()["device"]
    opt.host_tensors["exp_avg"] = list(moved)
    stats = opt.memory_stats()
    assert stats["host"] == {"exp_avg": storage_bytes(moved), "total": storage_bytes(moved)}
    assert stats["device"]["exp_avg"] == 0
    assert stats["device"]["total"] == before["total"] - storage_bytes(moved)


def test_fp8_weights_report_their_scales():
    model = tiny_transformer()
    fp8.convert(model, recipe="delayed", amax_history_len=3, amax_compute_algo="max")
    _, opt = build(model, optimizer="adam", fp8_recipe="delayed", fp8_amax_history_len=3,
                   fp8_amax_compute_algo="max", clip_grad=0.0)
    weights = [p for p in model.parameters() if fp8.is_fp8(p)]
    assert weights
    device = opt.memory_stats()["device"]
    assert device["fp8_scales"] == len(weights) * (4 + 4 + 3 * 4)  # scale, scale_inv, 3-long amax history
    assert device["main_params"] == 4 * sum(buf.numel for buf in opt.layout.buffers if buf.param_dtype.itemsize == 1)


def test_the_replay_backend_keeps_no_graph_pool():
    model, opt = build(optimizer="adam", capture="graph", capture_warmup_steps=1)
    for step in range(3):
        opt.zero_grad()
        loss_fn(model, step).backward()
        opt.step()
    assert opt.captured and opt.capture_backend == "replay"
    assert "graph_pool" not in opt.memory_stats()["device"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")
def test_a_captured_cuda_step_reports_its_graph_pool():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).cuda()
    model, opt = build(model, optimizer="adam", capture="graph", capture_warmup_steps=1, clip_grad=1.0)
    x = torch.randn(8, 64, device="cuda")
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert opt.captured and opt.capture_backend == "cuda"
    device = opt.memory_stats()["device"]
    assert device["graph_pool"] > 0  # the norm's and clip's temporaries live in the graph's pool
    assert device["total"] == sum(v for k, v in device.items() if k != "total")
