"""The rows' norms every grad norm is summed from (graphstep/kernels/row_norms.py): graphstep's native loop for fp32
rows on the CPU, torch's vector norm elsewhere. The native loop's norms are each row's within fp32 rounding of an
fp64 reference, the same bits at every thread count, and what a captured step replays."""

import pytest
import torch

from graphstep.kernels import row_norms as row_norms_module
from graphstep.native import update_loops


@pytest.fixture(scope="module")
def native():
    if update_loops.library() is None:
        pytest.skip(update_loops.status())


def _rows(count: int = 37, length: int = 4096) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(count, length, generator=generator)
    rows[1] *= 1e-20  # tiny and huge rows: the fp32 sum of squares, as torch's, underflows or overflows alike
    rows[2] *= 1e18
    return rows


def test_native_norms_are_each_rows_norm_within_fp32_rounding(native):
    rows = _rows()
    ours = torch.empty(rows.shape[0])
    assert update_loops.row_norms_cover(rows, ours)
    row_norms_module.row_norms(rows, ours)
    exact = torch.linalg.vector_norm(rows.double(), dim=1)
    finite = torch.isfinite(torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32))
    assert torch.equal(torch.isfinite(ours), finite)  # the overflowing row overflows, as torch's does
    assert torch.allclose(ours[finite].double(), exact[finite], rtol=2e-6, atol=0.0)


@pytest.mark.parametrize("threads", [1, 3])
def test_native_norms_do_not_depend_on_the_thread_count(native, threads):
    rows = _rows(count=41)
    ours, theirs = torch.empty(41), torch.empty(41)
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        row_norms_module.row_norms(rows, ours)
        torch.set_num_threads(threads)
        row_norms_module.row_norms(rows, theirs)
    finally:
        torch.set_num_threads(was)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def test_rows_the_native_loop_does_not_take_go_through_torch(native, monkeypatch):
    calls = []
    monkeypatch.setattr(update_loops, "row_norms", lambda rows, out: calls.append(rows))
    for rows in (_rows().bfloat16(), _rows(length=4100), _rows()[:, :4080]):  # dtype, length, layout
        out = torch.empty(rows.shape[0])
        row_norms_module.row_norms(rows, out)
        assert torch.equal(out, torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32))
    assert calls == []


def test_a_captured_step_replays_the_native_norm(native):
    import graphstep as gs

    torch.manual_seed(0)
    models = [torch.nn.Linear(256, 256) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [gs.get_optimizer(gs.OptimizerConfig(lr=1e-2, clip_grad=0.5, capture=capture, capture_warmup_steps=1,
                                                fold_grad_norm=False), model)
            for model, capture in zip(models, ("eager", "graph"))]
    for step in range(4):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(step))
        norms = []
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(x).square().sum().backward()
            norms.append(opt.step().grad_norm.clone())
        assert torch.equal(norms[0], norms[1]), step
    assert opts[1].captured
    for a, b in zip(*(model.parameters() for model in models)):
        assert torch.equal(a, b)
