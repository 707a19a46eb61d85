"""capture.graph: warm-up counting, capture call counts as a step, lifecycle."""
import pytest
import torch

import capture


def _counter_step():
    """A step whose every application adds 1 to `acc`; `calls` counts Python runs."""
    acc = torch.zeros(3)
    calls = []

    def step():
        calls.append(1)
        acc.add_(1.0)
        return acc * 2

    return step, acc, calls


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_warmup_then_capture_then_replay(warmup):
    step, acc, calls = _counter_step()
    g = capture.graph(step, warmup=warmup, backend="replay")
    for i in range(warmup):
        g()
        assert not g.captured
        assert len(calls) == i + 1
    g()  # the capture call
    assert g.captured and g.num_replays == 0
    assert len(calls) == warmup + 1
    for i in range(4):
        g()
        assert g.num_replays == i + 1
    # Python ran only for the warm-ups and the capture; every call was a step.
    assert len(calls) == warmup + 1
    assert g.num_calls == warmup + 5
    assert torch.equal(acc, torch.full((3,), float(warmup + 5)))


def test_capture_call_counts_as_exactly_one_step():
    step, acc, _ = _counter_step()
    g = capture.graph(step, warmup=1, backend="replay")
    g()
    assert acc[0] == 1
    g()  # capture
    assert acc[0] == 2
    g()
    assert acc[0] == 3


def test_outputs_are_graph_owned_and_updated_in_place():
    step, acc, _ = _counter_step()
    g = capture.graph(step, warmup=1, backend="replay")
    warm = g()
    out = g()
    kept = out.clone()
    again = g()
    assert again is out  # same object every replay
    assert torch.equal(out, torch.full((3,), 6.0))
    assert torch.equal(kept, torch.full((3,), 4.0))
    assert torch.equal(warm, torch.full((3,), 2.0))  # the warm-up result is the caller's


def test_auto_picks_replay_without_gpu_and_eager_always_runs():
    step, acc, calls = _counter_step()
    if not torch.cuda.is_available():
        assert capture.graph(step).backend == "replay"
    g = capture.graph(step, backend="eager", warmup=1)
    for _ in range(5):
        g()
    assert g.backend == "eager" and not g.captured and g.num_replays == 0
    assert len(calls) == 5 and acc[0] == 5


def test_auto_with_cpu_static_inputs_is_replay():
    x = torch.zeros(2)
    g = capture.graph(lambda: x.add_(1), static_inputs={"x": x})
    assert g.backend == "replay"


def test_unknown_backend_and_bad_warmup_rejected():
    with pytest.raises(ValueError, match="unknown capture backend"):
        capture.graph(lambda: None, backend="tpu")
    with pytest.raises(ValueError, match="warmup"):
        capture.graph(lambda: None, warmup=-1)
    with pytest.raises(TypeError):
        capture.graph(42)


def test_invalidate_recaptures_without_new_warmup():
    step, acc, calls = _counter_step()
    g = capture.graph(step, warmup=2, backend="replay")
    for _ in range(4):
        g()
    assert len(calls) == 3
    g.invalidate()
    assert not g.captured
    g()  # captures again at once
    assert g.captured and len(calls) == 4
    g()
    assert len(calls) == 4
    assert acc[0] == 6


def test_invalidate_with_a_warmup_runs_that_many_eager_calls_before_capturing_again():
    step, acc, calls = _counter_step()
    g = capture.graph(step, warmup=1, backend="replay")
    g(), g(), g()
    assert g.captured and len(calls) == 2
    g.invalidate(warmup=2)
    g(), g()
    assert not g.captured and len(calls) == 4  # two eager calls
    g()
    assert g.captured and len(calls) == 5
    g()
    assert len(calls) == 5 and acc[0] == 7  # seven calls, each applied once
    with pytest.raises(ValueError, match="warmup"):
        g.invalidate(warmup=-1)


def test_invalidate_picks_up_new_python_values():
    p = torch.zeros(2)
    holder = {"lr": 1.0}
    g = capture.graph(lambda: p.add_(holder["lr"]), warmup=0, backend="replay")
    g()
    holder["lr"] = 10.0
    g()
    assert torch.equal(p, torch.full((2,), 2.0))  # frozen
    g.invalidate()
    g()
    assert torch.equal(p, torch.full((2,), 12.0))


def test_close_and_context_manager():
    step, acc, _ = _counter_step()
    with capture.graph(step, backend="replay") as g:
        g(), g(), g()
    assert g.closed and not g.captured
    with pytest.raises(RuntimeError, match="closed"):
        g()
    g.close()  # idempotent
    assert acc[0] == 3


def test_graphs_are_independent():
    a, b = torch.zeros(1), torch.zeros(1)
    ga = capture.graph(lambda: a.add_(1), warmup=0, backend="replay")
    gb = capture.graph(lambda: b.add_(10), warmup=0, backend="replay")
    ga(), gb(), ga()
    gb.close()
    ga()
    assert a.item() == 3 and b.item() == 10
    assert "replay" in repr(ga)


def test_import_does_not_need_cuda():
    # The CUDA backend exists on every build; its stream/graph objects are lazy.
    from capture.backends.cuda import CudaBackend

    backend = CudaBackend()
    assert backend._stream is None and backend._graph is None
    backend.close()


def test_every_backend_implements_the_interface():
    from capture.backends import Backend, CudaBackend, EagerBackend, ReplayBackend

    for cls in (CudaBackend, EagerBackend, ReplayBackend):
        assert isinstance(cls(), Backend), cls
    assert {cls.name for cls in (CudaBackend, EagerBackend, ReplayBackend)} == {"cuda", "eager", "replay"}
