"""The CPU replay backend: bitwise equal to eager, CUDA-graph semantics, refusals."""
import os

import pytest
import torch

import capture
from _source import line_of

HERE = os.path.basename(__file__)


def _line_of(marker: str) -> int:
    return line_of(__file__, marker)


def _bitwise_equal(a, b):
    """Same dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _tensors(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _run_both(make, steps, feed=None, **graph_kwargs):
    """Run make()'s step eagerly, then captured, from identical states; compare bitwise.

    make(): returns (fn, dict of state tensors). feed(state, i): fills inputs (like
    grads) before step i, outside the step, in place. The two runs are sequential, each
    after the same manual_seed, so steps that draw random numbers can be compared too.
    """
    def history(fn, state):
        rows = []
        for i in range(steps):
            if feed is not None:
                feed(state, i)
            out = fn()
            rows.append(([t.clone() for t in _tensors(out)], {k: v.clone() for k, v in state.items()}))
        return rows

    torch.manual_seed(0)
    fn_e, st_e = make()
    eager = history(fn_e, st_e)
    torch.manual_seed(0)
    fn_c, st_c = make()
    g = capture.graph(fn_c, warmup=1, backend="replay", **graph_kwargs)
    replayed = history(g, st_c)
    for i, ((out_e, s_e), (out_c, s_c)) in enumerate(zip(eager, replayed)):
        assert len(out_e) == len(out_c)
        for a, b in zip(out_e, out_c):
            assert _bitwise_equal(a, b), f"output differs at step {i}"
        for k in s_e:
            assert _bitwise_equal(s_e[k], s_c[k]), f"{k} differs at step {i}"
    assert g.captured and g.num_replays == steps - 2
    return st_e, st_c


# --------------------------------------------------------------------------- frozen vs live
def test_python_float_is_frozen_while_tensor_lr_is_live():
    class Holder:
        value = 0.1

    p_float, p_tensor = torch.ones(4), torch.ones(4)
    grad = torch.ones(4)
    lr = torch.tensor(0.1)

    g_float = capture.graph(lambda: p_float.add_(grad, alpha=-Holder.value), warmup=0, backend="replay")
    g_tensor = capture.graph(lambda: p_tensor.sub_(grad * lr), warmup=0, backend="replay")
    g_float(), g_tensor()  # capture with lr 0.1
    Holder.value = 0.5
    lr.fill_(0.5)
    g_float(), g_tensor()
    # Python float baked at capture: second step still used 0.1.
    assert torch.allclose(p_float, torch.full((4,), 1 - 0.1 - 0.1))
    # 0-d tensor read at replay: second step used 0.5.
    assert torch.allclose(p_tensor, torch.full((4,), 1 - 0.1 - 0.5))


def test_torch_tensor_made_inside_step_is_refused_not_frozen():
    # It used to become a constant, frozen at capture; on a GPU it is a host-to-device copy a CUDA
    # capture refuses, so the strict replay backend refuses it too (tests/test_capture_strict.py).
    p = torch.zeros(2)
    box = [1.0]
    g = capture.graph(lambda: p.add_(torch.tensor(box[0])), warmup=0, backend="replay")
    with pytest.raises(capture.CaptureError, match="lift_fresh"):
        g()


# --------------------------------------------------------------------------- bitwise vs eager
def _make_views():
    flat = torch.randn(10)
    p1 = flat[:6].view(2, 3)
    p2 = flat[6:]
    acc = torch.zeros(())

    def step():
        g = torch.sin(p1) * 0.1
        p1.sub_(g)
        p2.mul_(0.99).add_(p1.sum() * 1e-3)
        flat[::2].add_(1e-3)
        acc.add_(flat.square().sum())
        return p1.norm(), g  # a fresh temporary as output

    return step, {"flat": flat, "acc": acc}


def test_inplace_updates_and_views_bitwise():
    _run_both(_make_views, 60)


def _make_where():
    p = torch.randn(8)
    grad = torch.zeros(8)
    lr = torch.tensor(0.05)
    good_steps = torch.zeros((), dtype=torch.int64)

    def step():
        found_inf = torch.logical_not(torch.isfinite(grad).all())
        new_p = torch.where(found_inf, p, p - lr * grad)
        p.copy_(new_p)
        good_steps.add_(found_inf.logical_not().to(good_steps.dtype))
        clipped = torch.clamp(grad, -1, 1)
        return {"found_inf": found_inf, "clipped": clipped}

    return step, {"p": p, "grad": grad, "lr": lr, "good_steps": good_steps}


def _feed_where(st, i):
    gen = torch.Generator().manual_seed(i)
    st["grad"].copy_(torch.randn(8, generator=gen))
    if i % 7 == 3:
        st["grad"][2] = float("inf")
    if i % 11 == 5:
        st["grad"][0] = float("nan")
    st["lr"].fill_(0.05 / (1 + i))


def test_where_conditionals_with_skipped_steps_bitwise():
    st_e, st_c = _run_both(_make_where, 55, _feed_where)
    skipped = sum(1 for i in range(55) if i % 7 == 3 or i % 11 == 5)
    assert st_c["good_steps"].item() == 55 - skipped


def _make_foreach():
    ps = [torch.randn(3), torch.randn(2, 2), torch.randn(5)]
    ms = [torch.zeros_like(p) for p in ps]

    def step():
        torch._foreach_mul_(ms, 0.9)
        grads = torch._foreach_mul(ps, 0.1)  # list output: placeholders
        torch._foreach_add_(ms, grads, alpha=0.1)
        norms = torch._foreach_norm(grads)
        total = torch.stack(norms).norm()
        torch._foreach_sub_(ps, ms)
        vals, idx = torch.max(ps[1], dim=0)  # tuple output
        first, second = torch.split(ps[2], [2, 3])
        second.mul_(1.0001)
        return total, vals, idx, first

    state = {f"p{i}": p for i, p in enumerate(ps)}
    state.update({f"m{i}": m for i, m in enumerate(ms)})
    return step, state


def test_foreach_and_tuple_outputs_bitwise():
    _run_both(_make_foreach, 50)


def _make_rng():
    p = torch.zeros(6)

    def step():
        noise = torch.randn(6) * 0.01
        p.add_(noise)
        return noise

    return step, {"p": p}


def test_rng_ops_draw_the_same_sequence_as_eager():
    st_e, st_c = _run_both(_make_rng, 20, allow_rng=True)
    assert st_c["p"].abs().sum() > 0


def test_fused_adamw_over_views_of_one_flat_buffer_bitwise():
    def make():
        torch.manual_seed(1)
        shapes = [(4, 3), (7,), (2, 2, 2)]
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        n = sum(sizes)
        param_flat, grad_flat = torch.randn(n), torch.zeros(n)
        m_flat, v_flat = torch.zeros(n), torch.zeros(n)

        def views(flat):
            return [v.view(s) for v, s in zip(flat.split(sizes), shapes)]

        params, grads, ms, vs = views(param_flat), views(grad_flat), views(m_flat), views(v_flat)
        steps = [torch.zeros((), dtype=torch.float32) for _ in shapes]
        lr = torch.tensor(1e-2, dtype=torch.float64)

        def step():
            torch._foreach_add_(steps, 1)  # as torch.optim does: the kernel reads, not bumps
            torch._fused_adamw_(
                params, grads, ms, vs, [], steps, lr=lr, beta1=0.9, beta2=0.95,
                weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
            )

        state = dict(param_flat=param_flat, grad_flat=grad_flat, m=m_flat, v=v_flat, lr=lr)
        state.update({f"step{i}": s for i, s in enumerate(steps)})
        return step, state

    def feed(st, i):
        st["grad_flat"].copy_(torch.randn(st["grad_flat"].shape, generator=torch.Generator().manual_seed(i)))
        st["lr"].fill_(1e-2 * (0.9**i))

    st_e, st_c = _run_both(make, 20, feed)
    assert st_c["step0"].item() == 20
    assert torch.isfinite(st_c["param_flat"]).all() and st_c["m"].abs().sum() > 0


def test_fresh_outputs_copied_views_of_static_memory_live():
    p = torch.arange(4.0)

    def step():
        p.add_(1)
        return p.view(2, 2), p * 10

    g = capture.graph(step, warmup=0, backend="replay")
    view, tens = g()
    g()
    assert torch.equal(view, torch.arange(4.0).view(2, 2) + 2)
    assert torch.equal(tens, (torch.arange(4.0) + 2) * 10)


def test_leaf_params_requiring_grad_replay_under_no_grad():
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 0.5)

    @torch.no_grad()
    def step():
        w.sub_(w.grad * 0.1)

    g = capture.graph(step, warmup=1, backend="replay")
    for _ in range(4):
        g()
    assert torch.allclose(w.detach(), torch.full((3,), 1 - 4 * 0.05))


# --------------------------------------------------------------------------- refusals
def test_planted_item_refused_with_op_and_line():
    p = torch.ones(3)

    def step():
        lr = p.sum().item()  # PLANT-ITEM
        p.mul_(lr)

    g = capture.graph(step, warmup=1, backend="replay")
    g()  # warm-up runs eagerly: fine
    with pytest.raises(capture.CaptureError) as info:
        g()
    msg = str(info.value)
    assert "aten._local_scalar_dense.default" in msg
    assert f"{HERE}:{_line_of('PLANT-ITEM')}" in msg
    assert "p.sum().item()" in msg
    assert info.value.findings[0].kind == "host_sync"
    assert not g.captured


def test_planted_if_tensor_refused_with_op_and_line():
    p = torch.ones(3)

    def step():
        if (p > 0).all():  # PLANT-IF
            p.add_(1)

    g = capture.graph(step, warmup=0, backend="replay")
    with pytest.raises(capture.CaptureError) as info:
        g()
    msg = str(info.value)
    assert "aten._local_scalar_dense.default" in msg or "aten.is_nonzero" in msg
    assert f"{HERE}:{_line_of('PLANT-IF')}" in msg


@pytest.mark.parametrize(
    "body, op",
    [
        (lambda p: p.tolist(), "Tensor.tolist"),
        (lambda p: p.numpy(), "Tensor.numpy"),
        (lambda p: p.nonzero(), "aten.nonzero.default"),
        (lambda p: p[p > 1.5], "aten.index.Tensor"),
        (lambda p: torch.masked_select(p, p > 1.5), "aten.masked_select.default"),
    ],
)
def test_other_host_reads_refused(body, op):
    p = torch.arange(3.0)
    g = capture.graph(lambda: body(p), warmup=0, backend="replay")
    with pytest.raises(capture.CaptureError, match=op.replace(".", r"\.")):
        g()


def test_integer_indexing_is_allowed():
    p = torch.arange(5.0)
    idx = torch.tensor([4, 0])

    def step():
        p[idx] += 1
        return p[idx] * 2

    g = capture.graph(step, warmup=0, backend="replay")
    g(), g()
    assert torch.equal(p, torch.tensor([2.0, 1, 2, 3, 6]))


def test_refusal_survives_a_swallowed_exception():
    p = torch.ones(2)

    def step():
        try:
            p.sum().item()
        except capture.CaptureError:
            pass
        p.add_(1)

    g = capture.graph(step, warmup=0, backend="replay")
    with pytest.raises(capture.CaptureError):
        g()
    assert not g.captured


def test_autocast_inside_step_replays_bitwise_and_outer_autocast_is_ignored():
    def make():
        w = torch.randn(8, 8)
        x = torch.randn(4, 8)
        acc = torch.zeros(4, 8)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = x @ w  # bf16 matmul: the casts are recorded ops
            acc.add_(y.float())
            w.mul_(0.999)
            return y

        return step, {"w": w, "acc": acc}

    _run_both(make, 12)


def test_replay_is_the_recorded_program_even_under_a_callers_autocast():
    w, x = torch.randn(16, 16), torch.randn(4, 16)
    out = torch.zeros(4, 16)

    def step():
        out.copy_(x @ w)  # recorded as an fp32 mm

    g = capture.graph(step, warmup=0, backend="replay")
    g()
    expected = out.clone()
    out.zero_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g()  # autocast must not recast the recorded fp32 matmul to bf16
    assert torch.equal(out, expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(step() or out, expected)  # what eager would do here


def _make_alias(make_alias):
    def make():
        p = torch.randn(6)

        def step():
            tmp = p * 2
            make_alias(tmp)[1:].add_(1)
            p.copy_(tmp * 0.5)
            return tmp

        return step, {"p": p}

    return make


def test_dot_data_of_a_temporary_replays():
    _run_both(_make_alias(lambda t: t.data), 10)  # .data dispatches aten.detach


def test_alias_of_a_temporary_made_without_dispatch_is_replayed_as_a_view():
    # from_dlpack builds a new tensor on the same memory without any aten op: the
    # recorder must see it as a view of the placeholder, not bake the capture buffer.
    _run_both(_make_alias(torch.from_dlpack), 10)


def test_dot_data_of_a_persistent_tensor_is_the_tensor_itself():
    p = torch.zeros(3)
    g = capture.graph(lambda: p.data.add_(1), warmup=0, backend="replay")
    for _ in range(3):
        g()
    assert torch.equal(p, torch.full((3,), 3.0))


def _make_escaping():
    p = torch.randn(4)
    results = {}

    def step():
        p.mul_(0.9)
        results["norm"] = p.norm()  # stored, not returned: an escaping tensor
        results["view"] = results["norm"].view(1)

    return step, {"p": p}, results


def test_escaping_tensors_follow_each_replay_like_cuda_graph_memory():
    torch.manual_seed(0)
    step, st, results = _make_escaping()
    g = capture.graph(step, warmup=1, backend="replay")
    for _ in range(5):
        g()
    norm, view = results["norm"], results["view"]
    assert torch.equal(norm, st["p"].norm())
    g()
    assert torch.equal(norm, st["p"].norm()) and torch.equal(view, norm.view(1))
    assert results["norm"] is norm  # Python did not run: the dict holds the capture-time tensor


def _make_nested_holes():
    p = torch.randn(6)
    q = torch.randn(6)

    def step():
        idx = torch.argsort(q)[:3]  # a placeholder inside the Tensor?[] indices list
        p.index_put_((idx,), p[idx] * 0.5 + 1, accumulate=True)
        q.add_(p * 0.1)
        parts = list(torch.chunk(p, 3))  # placeholders in a TensorList argument
        total = torch.stack(parts, dim=0).sum(0)
        return torch.cat([total, idx.to(p.dtype)])

    return step, {"p": p, "q": q}


def test_placeholders_nested_in_list_arguments_bitwise():
    _run_both(_make_nested_holes, 30)


def test_replay_keeps_the_matmul_precision_each_op_was_recorded_under():
    # A step that runs some matmuls at "highest" inside a job at "medium" (Muon's Newton-Schulz) must
    # replay them at "highest", not at whatever the global setting is when the replay runs.
    a = torch.randn(4, 128, 256, generator=torch.Generator().manual_seed(0))
    out = torch.zeros(4, 128, 128)

    def step():
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            torch.bmm(a, a.transpose(1, 2), out=out)
        finally:
            torch.set_float32_matmul_precision(previous)

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        step()
        eager = out.clone()
        g = capture.graph(step, warmup=0, backend="replay")
        g()  # records
        out.zero_()
        g()  # replays under the global "medium"
        assert torch.equal(out, eager)
        assert torch.get_float32_matmul_precision() == "medium"  # the caller's setting is restored
    finally:
        torch.set_float32_matmul_precision(previous)


# --------------------------------------------------------------------------- storage resizes (FSDP2's)
def _make_resizing():
    """FSDP2's pattern: a persistent tensor (and a view made once) over a storage the step allocates, fills, reads
    and frees again."""
    src = torch.randn(8)
    gathered = torch.empty(8)
    view = gathered[2:6]  # made while allocated, as FSDP2's unsharded param is
    gathered.untyped_storage().resize_(0)
    out = torch.zeros(4)

    def step():
        gathered.untyped_storage().resize_(gathered.numel() * gathered.element_size())
        gathered.copy_(src)
        out.mul_(0.5).add_(view * 2)
        gathered.untyped_storage().resize_(0)
        src.add_(1.0)

    return step, {"src": src, "out": out}


def test_storage_resized_inside_the_step_replays_bitwise():
    # Before storage resizes were recorded, the first replay found `gathered` at a new (null) address and
    # refused it as replaced; recording every iteration again instead.
    _, st = _run_both(_make_resizing, 12)
    assert st["out"].abs().sum() > 0


def test_a_replay_frees_what_the_step_freed_and_a_replaced_tensor_is_still_refused():
    gathered = torch.empty(8)
    gathered.untyped_storage().resize_(0)
    out = torch.zeros(8)

    def step():
        gathered.untyped_storage().resize_(32)
        gathered.fill_(1.0)
        out.add_(gathered)
        gathered.untyped_storage().resize_(0)

    g = capture.graph(step, warmup=1, backend="replay")
    for _ in range(3):
        g()
    assert g.num_replays == 1 and torch.equal(out, torch.full((8,), 3.0))
    assert gathered.untyped_storage().size() == 0  # freed after the replay, as after the eager step
    gathered.data = torch.empty(8)  # other memory, another storage: the recorded program would not see it
    with pytest.raises(capture.StaleInputError, match="replaced after capture"):
        g()


def test_a_storage_resize_of_a_temporary_is_refused_naming_the_line():
    src = torch.randn(8)

    def step():
        tmp = src * 2
        tmp.untyped_storage().resize_(0)  # RESIZE-TEMPORARY

    g = capture.graph(step, warmup=0, backend="replay")
    with pytest.raises(capture.CaptureError, match="resizes the storage of a tensor the step itself made") as info:
        g()
    (finding,) = info.value.findings
    assert finding.kind == "temporary_resize" and finding.lineno == _line_of("RESIZE-TEMPORARY")
    assert os.path.basename(finding.filename) == HERE
