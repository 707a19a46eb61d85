"""Static-input guards: a replaced, moved or resized input is refused before replay."""
import re

import pytest
import torch

import capture
from capture.guards import StaticInputGuard, TensorSignature


def test_parameter_data_swap_is_caught():
    w = torch.nn.Parameter(torch.ones(4))
    g_flat = torch.full((4,), 0.5)

    @torch.no_grad()
    def step():
        w.sub_(g_flat * 0.1)

    graph = capture.graph(step, warmup=1, backend="replay", static_inputs=lambda: {"w": w, "grad_flat": g_flat})
    graph(), graph(), graph()
    old_ptr = w.data_ptr()
    w.data = torch.ones(4)  # same Parameter object, new memory
    assert w.data_ptr() != old_ptr
    with pytest.raises(capture.StaleInputError) as info:
        graph()
    msg = str(info.value)
    assert re.search(r"static input 'w' moved \(0x[0-9a-f]+ -> 0x[0-9a-f]+\)", msg)
    assert f"0x{old_ptr:x} -> 0x{w.data_ptr():x}" in msg
    assert "the captured step would read the old memory" in msg
    assert "call invalidate() (or the owner's recapture()) after replacing tensors" in msg
    assert "grad_flat" not in msg
    # The replay did not run: the new w is untouched.
    assert torch.equal(w.detach(), torch.ones(4))
    graph.invalidate()
    graph()
    assert torch.allclose(w.detach(), torch.full((4,), 0.95))
    graph()  # the new address is the recorded one now
    assert torch.allclose(w.detach(), torch.full((4,), 0.9))


def test_resize_is_caught_even_when_the_address_stays():
    buf = torch.zeros(8)
    graph = capture.graph(lambda: buf.add_(1), warmup=0, backend="replay", static_inputs={"buf": buf})
    graph(), graph()
    buf.resize_(4)  # shrinking keeps the storage
    with pytest.raises(capture.StaleInputError, match=r"static input 'buf' changed shape \(8,\) -> \(4,\)"):
        graph()


def test_growing_resize_reports_move_and_shape():
    buf = torch.zeros(2)
    graph = capture.graph(lambda: buf.add_(1), warmup=0, backend="replay", static_inputs={"buf": buf})
    graph()
    buf.resize_(1 << 16)
    with pytest.raises(capture.StaleInputError, match=r"moved .* and changed shape"):
        graph()


def test_stale_hint_replaces_the_advice():
    x = torch.zeros(2)
    holder = {"x": x}
    graph = capture.graph(
        lambda: holder["x"].add_(1), warmup=0, backend="replay",
        static_inputs=lambda: dict(holder), stale_hint="call opt.recapture() after replacing parameters",
    )
    graph()
    holder["x"] = torch.zeros(2)
    with pytest.raises(capture.StaleInputError) as info:
        graph()
    assert str(info.value).endswith(
        "the captured step would read the old memory; call opt.recapture() after replacing parameters"
    )
    assert "invalidate()" not in str(info.value)


def test_callable_is_reevaluated_and_missing_or_new_names_are_stale():
    a, b = torch.zeros(1), torch.zeros(1)
    inputs = {"a": a}
    guard = StaticInputGuard(lambda: inputs)
    guard.record()
    guard.verify()
    inputs = {"a": a, "b": b}
    with pytest.raises(capture.StaleInputError, match="'b' was not there at capture"):
        guard.verify()
    inputs = {}
    with pytest.raises(capture.StaleInputError, match="'a' is gone"):
        guard.verify()


def test_dtype_and_stride_changes():
    x = torch.zeros(2, 3)
    old = TensorSignature.of(x)
    assert old.differences(TensorSignature.of(x)) == []
    assert any("stride" in d for d in old.differences(TensorSignature.of(x.t())))
    diffs = old.differences(TensorSignature.of(x.double()))
    assert any("dtype torch.float32 -> torch.float64" in d for d in diffs)


def test_non_tensor_inputs_rejected():
    with pytest.raises(TypeError, match="not a Tensor"):
        capture.graph(lambda: None, static_inputs={"lr": 0.1})  # "auto" looks at once
    graph = capture.graph(lambda: None, warmup=0, backend="replay", static_inputs={"lr": 0.1})
    with pytest.raises(TypeError, match="not a Tensor"):
        graph()


def test_static_inputs_callable_is_first_evaluated_at_capture():
    class Owner:
        pass

    owner = Owner()

    def step():
        if not hasattr(owner, "buf"):
            owner.buf = torch.zeros(3)  # created by the warm-up
        owner.buf.add_(1)

    graph = capture.graph(step, warmup=1, backend="replay", static_inputs=lambda: {"buf": owner.buf})
    for _ in range(3):
        graph()
    assert graph.captured and torch.equal(owner.buf, torch.full((3,), 3.0))


def test_eager_backend_does_not_guard():
    x = torch.zeros(2)
    holder = {"x": x}
    graph = capture.graph(lambda: holder["x"].add_(1), backend="eager", static_inputs=lambda: dict(holder))
    graph()
    holder["x"] = torch.zeros(2)
    graph()  # eager reads the current tensors: nothing can be stale
    assert holder["x"][0] == 1


def _lazy_step():
    holder = {"m": torch.empty(0)}

    def step():
        if holder["m"].numel() == 0:  # metadata, not a host sync: allowed
            holder["m"] = torch.zeros(4)  # lazily created state, like an optimizer's
        holder["m"].add_(1)

    return step, holder


def test_static_input_replaced_during_capture_asks_for_warmup():
    step, holder = _lazy_step()
    graph = capture.graph(step, warmup=0, backend="replay", static_inputs=lambda: dict(holder))
    with pytest.raises(capture.StaleInputError, match=r"while it was being captured; warm it up first"):
        graph()
    assert not graph.captured


def test_lazy_state_captures_fine_after_warmup():
    step, holder = _lazy_step()
    graph = capture.graph(step, warmup=1, backend="replay", static_inputs=lambda: dict(holder))
    for _ in range(4):
        graph()
    assert graph.captured
    assert torch.equal(holder["m"], torch.full((4,), 4.0))
