"""The replay backend refuses the stream and event orders a CUDA capture refuses (capture/backends/_strict.py).

On the CPU every torch.Stream is one stream and torch.Event cannot be made, so the rules run on stand-ins with the
same methods. Each rule: kept, the step captures and replays; broken, the capture is refused naming it.
"""

import pytest
import torch

import capture
from capture.backends._strict import STREAM_ORDER, StandInEvent, StandInStream, current_stream
from capture.errors import CaptureError


def _capture(step):
    graph = capture.graph(step, warmup=1, backend="replay")
    graph()  # warm-up
    graph()  # capture
    return graph


def _refusal(step) -> str:
    with pytest.raises(CaptureError) as caught:
        _capture(step)
    kinds = {f.kind for f in caught.value.findings}
    assert kinds == {STREAM_ORDER}, caught.value
    return " ".join(f.op for f in caught.value.findings)


@pytest.mark.parametrize("joined", [True, False])
def test_a_side_stream_forked_inside_the_capture_must_be_joined_before_it_ends(joined):
    x, y = torch.zeros(16), torch.zeros(16)
    side = StandInStream("side")

    def step():
        x.add_(1.0)
        side.wait_stream(current_stream())  # fork
        with side:
            y.add_(x)
        if joined:
            current_stream().wait_stream(side)

    if joined:
        graph = _capture(step)
        graph()
        assert torch.equal(y, torch.full((16,), 1.0 + 2.0 + 3.0))  # warm-up, capture, one replay
    else:
        assert "not joined" in _refusal(step)


@pytest.mark.parametrize("recorded_inside", [True, False])
def test_an_event_waited_on_inside_the_capture_must_be_recorded_inside_it(recorded_inside):
    x = torch.zeros(16)
    side = StandInStream("side")
    outside = side.record_event()

    def step():
        event = outside
        if recorded_inside:
            side.wait_stream(current_stream())  # side joins the capture, so its event is recorded inside it
            event = side.record_event()
        current_stream().wait_event(event)
        x.add_(1.0)

    if recorded_inside:
        _capture(step)()
    else:
        assert "outside the capture" in _refusal(step)


def test_an_event_synchronize_inside_the_capture_is_refused_as_a_host_sync():
    x = torch.zeros(16)

    def step():
        x.add_(1.0)
        event = StandInEvent()
        event.record()
        event.synchronize()

    assert "host sync" in _refusal(step)


def test_work_on_a_stream_the_capture_never_forked_is_refused():
    x = torch.zeros(16)
    side = StandInStream("unforked")

    def step():
        with side:
            x.add_(1.0)

    assert "never forked" in _refusal(step)


@pytest.mark.parametrize("waited", [True, False])
def test_the_step_must_wait_for_the_stream_that_wrote_its_grads(waited):
    # FSDP2: the reduce-scatter writes the grads on its own stream and records a post-reduce event; the step that
    # reads them must run after the current stream waited on that event (before the capture: an event recorded
    # outside the capture cannot be waited on inside it).
    param, grad = torch.ones(16), torch.zeros(16)
    reduce_scatter = StandInStream("reduce-scatter")

    def backward():
        with reduce_scatter:
            grad.fill_(0.5)
        post_reduce = reduce_scatter.record_event()
        if waited:
            current_stream().wait_event(post_reduce)

    def step():
        param.sub_(grad)

    graph = capture.graph(step, warmup=1, backend="replay")
    backward()
    graph()  # warm-up
    backward()
    if waited:
        graph()
        backward()
        graph()
        assert torch.equal(param, torch.full((16,), 1.0 - 3 * 0.5))
    else:
        with pytest.raises(CaptureError) as caught:
            graph()
        assert "without waiting for it" in str(caught.value) and "reduce-scatter" in str(caught.value)


def test_code_without_stand_ins_is_not_affected():
    x = torch.zeros(16)
    graph = _capture(lambda: x.add_(1.0))
    graph()
    assert torch.equal(x, torch.full((16,), 3.0))
