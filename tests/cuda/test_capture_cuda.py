"""The CUDA-graph backend on a real GPU (skipped without one).

Same contract as the replay backend: warm-ups eager, the capture call is one step
(replayed right after capturing), graph-owned outputs, stale inputs refused, results
bitwise equal to eager.
"""
import pytest
import torch

import capture

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

DEV = "cuda"
N = 1 << 12


def _make(seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    param_flat = torch.randn(N, device=DEV, generator=gen)
    grad_flat = torch.zeros(N, device=DEV)
    m_flat, v_flat = torch.zeros(N, device=DEV), torch.zeros(N, device=DEV)
    sizes = [N // 4, N // 4, N // 2]
    views = lambda flat: list(flat.split(sizes))  # noqa: E731
    params, grads, ms, vs = views(param_flat), views(grad_flat), views(m_flat), views(v_flat)
    steps = [torch.zeros((), device=DEV) for _ in sizes]
    lr = torch.tensor(1e-2, device=DEV)
    good = torch.zeros((), device=DEV, dtype=torch.int64)

    def step():
        found_inf = torch.logical_not(torch.isfinite(grad_flat).all())
        found_inf_f = found_inf.float()
        not_inf = 1.0 - found_inf_f
        # List overload: the 0-d tensor-scalar overload reads the scalar on the host.
        torch._foreach_add_(steps, [not_inf] * len(steps))  # skipped steps don't count
        torch._fused_adamw_(
            params, grads, ms, vs, [], steps, lr=lr, beta1=0.9, beta2=0.95, weight_decay=0.1,
            eps=1e-8, amsgrad=False, maximize=False, found_inf=found_inf_f,
        )
        good.add_(found_inf.logical_not().long())
        return param_flat.square().sum()  # a fresh tensor: graph-owned output

    state = dict(param_flat=param_flat, grad_flat=grad_flat, m=m_flat, v=v_flat, lr=lr, good=good)
    return step, state


def _feed(state, i):
    gen = torch.Generator(device=DEV).manual_seed(1000 + i)
    state["grad_flat"].copy_(torch.randn(N, device=DEV, generator=gen))
    if i == 7:
        state["grad_flat"][3] = float("inf")
    state["lr"].fill_(1e-2 / (1 + i))


def _history(call, state, steps):
    rows = []
    for i in range(steps):
        _feed(state, i)
        out = call()
        rows.append((out.clone(), {k: v.clone() for k, v in state.items()}))
    torch.cuda.synchronize()
    return rows


def test_auto_picks_cuda_for_cuda_inputs():
    x = torch.zeros(4, device=DEV)
    g = capture.graph(lambda: x.add_(1), static_inputs={"x": x})
    assert g.backend == "cuda"
    g.close()
    cpu = torch.zeros(4)
    assert capture.graph(lambda: cpu.add_(1), static_inputs={"x": cpu}).backend == "replay"


def test_graph_bitwise_equal_to_eager():
    steps = 20
    fn_e, st_e = _make()
    eager = _history(fn_e, st_e, steps)
    fn_c, st_c = _make()
    with capture.graph(fn_c, warmup=2, backend="cuda") as g:
        replayed = _history(g, st_c, steps)
        assert g.captured and g.num_replays == steps - 3
    for i, ((out_e, s_e), (out_c, s_c)) in enumerate(zip(eager, replayed)):
        assert torch.equal(out_e, out_c), f"output at step {i}"
        for k in s_e:
            assert torch.equal(s_e[k], s_c[k]), f"{k} at step {i}"
    assert st_c["good"].item() == steps - 1  # step 7 was skipped, on device


def test_capture_call_counts_as_one_step_and_python_float_is_frozen():
    acc = torch.zeros(8, device=DEV)
    holder = {"inc": 1.0}
    calls = []

    def step():
        calls.append(1)
        acc.add_(holder["inc"])

    g = capture.graph(step, warmup=1, backend="cuda")
    g()  # warm-up
    g()  # capture + replay once
    torch.cuda.synchronize()
    assert acc[0].item() == 2.0
    holder["inc"] = 100.0
    g(), g()
    torch.cuda.synchronize()
    assert acc[0].item() == 4.0  # baked 1.0, as in any CUDA graph
    assert len(calls) == 2
    g.close()


def test_outputs_are_graph_owned():
    x = torch.arange(4.0, device=DEV)

    def step():
        x.add_(1)
        return x * 2

    g = capture.graph(step, warmup=1, backend="cuda")
    g()
    out = g()
    kept = out.clone()
    assert g() is out
    torch.cuda.synchronize()
    assert torch.equal(out, (torch.arange(4.0, device=DEV) + 3) * 2)
    assert torch.equal(kept, (torch.arange(4.0, device=DEV) + 2) * 2)
    g.close()


def test_stale_input_detected_and_invalidate_recaptures():
    w = torch.nn.Parameter(torch.ones(16, device=DEV))

    @torch.no_grad()
    def step():
        w.mul_(0.5)

    g = capture.graph(step, warmup=1, backend="cuda", static_inputs=lambda: {"w": w})
    g(), g(), g()
    w.data = torch.ones(16, device=DEV)
    with pytest.raises(capture.StaleInputError, match="static input 'w' moved"):
        g()
    assert torch.equal(w.detach(), torch.ones(16, device=DEV))  # not replayed
    g.invalidate()
    g()
    torch.cuda.synchronize()
    assert torch.equal(w.detach(), torch.full((16,), 0.5, device=DEV))
    g.close()
    with pytest.raises(RuntimeError, match="closed"):
        g()


def test_shared_pool_between_graphs():
    pool = torch.cuda.graph_pool_handle()
    a = torch.zeros(32, device=DEV)
    b = torch.zeros(32, device=DEV)
    ga = capture.graph(lambda: a.add_(torch.ones_like(a)), warmup=1, backend="cuda", pool=pool)
    gb = capture.graph(lambda: b.add_(a * 2), warmup=1, backend="cuda", pool=pool)
    for _ in range(3):  # replay in capture order, as a shared pool requires
        ga()
        gb()
    torch.cuda.synchronize()
    assert torch.equal(a, torch.full((32,), 3.0, device=DEV))
    assert torch.equal(b, torch.full((32,), 2.0 + 4.0 + 6.0, device=DEV))
    gb.close()
    ga.close()
