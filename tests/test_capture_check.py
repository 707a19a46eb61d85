"""capture.check: every kind of finding, located at the user's line, all in one run."""
import os

import pytest
import torch

import capture
from capture import unsafe
from _source import line_of

HERE = os.path.basename(__file__)


def _line_of(marker: str) -> int:
    return line_of(__file__, marker)


def _kinds(findings):
    return [f.kind for f in findings]


def test_clean_step_has_no_findings():
    p, g = torch.ones(4), torch.ones(4)
    lr = torch.tensor(0.1)

    def step():
        found_inf = torch.logical_not(torch.isfinite(g).all())
        p.copy_(torch.where(found_inf, p, p - lr * g))
        return p.sum()  # a fresh tensor returned is an output, not an escape

    assert capture.check(step) == []


def test_collects_every_host_sync_without_stopping():
    p = torch.arange(4.0)

    def step():
        a = p.sum().item()  # CHECK-ITEM
        if p.any():  # CHECK-IF
            pass
        xs = p.tolist()  # CHECK-TOLIST
        nz = p.nonzero()  # CHECK-NONZERO
        sel = p[p > 1]  # CHECK-MASK
        p.add_(1)  # still runs: check lets every op through
        return a, xs, nz, sel

    findings = capture.check(step)
    assert all(f.kind == "host_sync" for f in findings)
    by_line = {f.lineno: f for f in findings}
    expected = {
        "CHECK-ITEM": "aten._local_scalar_dense.default",
        "CHECK-IF": "aten._local_scalar_dense.default",
        "CHECK-TOLIST": "Tensor.tolist",
        "CHECK-NONZERO": "aten.nonzero.default",
        "CHECK-MASK": "aten.index.Tensor",
    }
    for marker, op in expected.items():
        f = by_line[_line_of(marker)]
        assert f.op == op
        assert f.filename.endswith(HERE)
        assert marker in f.line
    assert torch.equal(p, torch.arange(4.0) + 1)  # fn ran exactly once


def test_finding_str_format():
    p = torch.ones(2)

    def step():
        return p.sum().item()  # CHECK-STR

    (f,) = capture.check(step)
    line = _line_of("CHECK-STR")
    assert str(f) == f"host_sync: aten._local_scalar_dense.default at {f.filename}:{line}: {f.line}"
    assert f.line.startswith("return p.sum().item()")


def test_rng_finding():
    p = torch.zeros(3)

    def step():
        p.add_(torch.randn(3))  # CHECK-RNG

    findings = capture.check(step)
    assert _kinds(findings) == ["rng"]
    assert findings[0].op == "aten.randn.default"
    assert findings[0].lineno == _line_of("CHECK-RNG")


def test_escaping_tensor_finding():
    p = torch.ones(3)
    stash = {}

    def step():
        tmp = p * 2  # CHECK-ESCAPE
        stash["tmp"] = tmp  # survives the step without being returned
        view = p.view(3)  # a view of static memory: not an escaping allocation
        stash["view"] = view
        p.add_(tmp)
        scratch = p + 1  # dies with the step: fine
        return scratch.sum()

    findings = capture.check(step)
    assert _kinds(findings) == ["escaping_tensor"]
    assert findings[0].op == "aten.mul.Tensor"
    assert findings[0].lineno == _line_of("CHECK-ESCAPE")


def test_escape_through_grad_attribute():
    w = torch.nn.Parameter(torch.ones(2))

    def step():
        w.grad = torch.zeros_like(w)  # CHECK-GRAD

    findings = capture.check(step)
    assert _kinds(findings) == ["escaping_tensor"]
    assert findings[0].lineno == _line_of("CHECK-GRAD")


def test_returned_views_of_fresh_tensors_are_not_escapes():
    p = torch.ones(4)

    def step():
        tmp = p * 3
        return tmp.view(2, 2)

    assert capture.check(step) == []


def test_device_to_host_classification():
    # No second device on a CPU-only machine: classify the op calls directly, with
    # meta tensors standing in for device memory.
    dev = torch.empty(3, device="meta")
    host = torch.empty(3)
    aten = torch.ops.aten
    assert unsafe.classify(aten._to_copy.default, (dev,), {"device": torch.device("cpu")}) == "device_to_host"
    assert unsafe.classify(aten.copy_.default, (host, dev), {}) == "device_to_host"
    assert unsafe.classify(aten._copy_from.default, (dev, host), {}) == "device_to_host"
    # Host to device is its own kind (a sync from pageable memory on a GPU); host to host and
    # device to device are neither.
    assert unsafe.classify(aten._to_copy.default, (host,), {"device": torch.device("meta")}) == "host_to_device"
    assert unsafe.classify(aten.copy_.default, (dev, host), {}) == "host_to_device"
    assert unsafe.classify(aten._copy_from.default, (host, dev), {}) == "host_to_device"
    assert unsafe.classify(aten.copy_.default, (host, host), {}) is None
    assert unsafe.classify(aten.copy_.default, (dev, dev), {}) is None
    assert unsafe.classify(aten._to_copy.default, (host,), {"dtype": torch.float64}) is None


def test_classification_of_index_ops():
    aten = torch.ops.aten
    x = torch.arange(4.0)
    assert unsafe.classify(aten.index.Tensor, (x, [x > 1]), {}) == "host_sync"
    assert unsafe.classify(aten.index.Tensor, (x, [torch.tensor([0, 2])]), {}) is None
    assert unsafe.classify(aten.index_put_.default, (x, [x > 1], x[:1]), {}) == "host_sync"
    assert unsafe.classify(aten.add.Tensor, (x, x), {}) is None


def test_capture_error_lists_all_findings():
    f1 = capture.Finding("host_sync", "aten.item.default", "a.py", 3, "x.item()")
    f2 = capture.Finding("rng", "aten.rand.default", "b.py", 9, "torch.rand(2)")
    err = capture.CaptureError("nope", [f1, f2])
    assert err.findings == (f1, f2)
    assert str(f1) in str(err) and str(f2) in str(err)
    assert isinstance(capture.StaleInputError("x"), capture.CaptureError)


def test_a_host_read_method_is_reported_once():
    p = torch.arange(3.0)

    def step():
        p.tolist()  # CHECK-ONCE
        p.numpy()

    findings = capture.check(step)
    assert [f.op for f in findings] == ["Tensor.tolist", "Tensor.numpy"]
    assert findings[0].lineno == _line_of("CHECK-ONCE")


def test_check_does_not_swallow_the_steps_exceptions():
    def step():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        capture.check(step)
    # The modes were exited: ordinary code runs unobserved afterwards.
    assert capture.check(lambda: torch.ones(2).add_(1)) == []


def test_check_reports_a_tensor_made_from_python_data():
    p = torch.zeros(2)
    findings = capture.check(lambda: p.add_(torch.tensor([1.0, 2.0])))
    assert [f.kind for f in findings] == ["host_tensor"]
    assert findings[0].op.startswith("aten.lift_fresh") and findings[0].filename.endswith("test_capture_check.py")
