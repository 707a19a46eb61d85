"""The replay backend as the strict twin of a CUDA graph (docs/design.md §9): one test per refusal.

Each refusal names the op and the user's source line; each would be a capture error, a
use-after-free or a silently frozen value on a GPU.
"""
import gc
import os
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist

import capture
from _harness import spawn, values
from _source import line_of

HERE = os.path.basename(__file__)


def _line_of(marker: str) -> int:
    return line_of(__file__, marker)


def _refusal(fn, **graph_kwargs) -> capture.CaptureError:
    g = capture.graph(fn, warmup=0, backend="replay", **graph_kwargs)
    with pytest.raises(capture.CaptureError) as info:
        g()
    assert not g.captured
    return info.value


# --------------------------------------------------------------------------- inputs held weakly
def test_a_freed_input_is_an_error_at_replay_naming_it_and_nothing_runs():
    acc = torch.zeros(3)
    box = {"inc": torch.ones(3)}
    g = capture.graph(lambda: acc.add_(box["inc"]), warmup=0, backend="replay")  # READ-INC
    g(), g()
    assert torch.equal(acc, torch.full((3,), 2.0))
    old = weakref.ref(box["inc"])
    box["inc"] = torch.full((3,), 100.0)  # the captured tensor's last reference goes
    gc.collect()
    assert old() is None  # the backend kept no strong reference to it
    with pytest.raises(capture.StaleInputError) as info:
        g()
    msg = str(info.value)
    assert "freed after capture" in msg and "aten.add_.Tensor" in msg
    assert f"{HERE}:{_line_of('READ-INC')}" in msg and "float32[3]" in msg
    assert torch.equal(acc, torch.full((3,), 2.0))  # raised before any op ran
    g.invalidate()
    g()  # a fresh capture reads the new tensor
    assert torch.equal(acc, torch.full((3,), 102.0))


def test_an_input_given_new_memory_is_an_error_at_replay():
    w = torch.ones(4)
    g = capture.graph(lambda: w.mul_(2), warmup=0, backend="replay")  # READ-W
    g()
    w.data = torch.ones(4)  # same Python object, new memory: a CUDA graph keeps the old address
    with pytest.raises(capture.StaleInputError) as info:
        g()
    msg = str(info.value)
    assert "replaced after capture" in msg and f"{HERE}:{_line_of('READ-W')}" in msg
    assert torch.equal(w, torch.ones(4))


def test_a_view_whose_object_died_replays_from_its_live_storage():
    # What a CUDA graph holds is memory: while the storage lives, the replay is valid.
    def make():
        flat = torch.arange(6.0)
        views = [flat[:3], flat[3:]]

        def step():
            views[0].mul_(2)
            views[1].add_(views[0])

        return flat, views, step

    flat_e, _, step_e = make()
    for _ in range(4):
        step_e()
    flat_c, views, step_c = make()
    g = capture.graph(step_c, warmup=1, backend="replay")
    g(), g()
    views.clear()  # the view objects die; flat keeps their memory alive
    gc.collect()
    g(), g()
    assert torch.equal(flat_c, flat_e)


# --------------------------------------------------------------------------- host data entering the step
def test_a_tensor_made_from_python_data_inside_the_step_is_refused():
    p = torch.zeros(2)
    value = [0.5]

    def step():
        p.add_(torch.tensor(value[0], device=p.device))  # PLANT-TENSOR

    err = _refusal(step)
    assert err.findings[0].kind == "host_tensor"
    assert err.findings[0].op.startswith("aten.lift_fresh")
    assert f"{HERE}:{_line_of('PLANT-TENSOR')}" in str(err)
    assert "fill_() it before each step" in str(err)
    assert torch.equal(p, torch.zeros(2))  # refused before the op ran (the recording stops there)


def test_python_scalars_and_full_are_not_host_tensors():
    def make():
        p = torch.zeros(3)

        def step():
            p.add_(1.5)  # a Python scalar: a kernel argument, baked on every backend
            p.copy_(torch.where(p > 2, p, torch.full_like(p, 0.25)) + torch.scalar_tensor(1.0))

        return p, step

    p_e, step_e = make()
    for _ in range(3):
        step_e()
    p_c, step_c = make()
    g = capture.graph(step_c, warmup=0, backend="replay")
    g(), g(), g()
    assert g.num_replays == 2 and torch.equal(p_c, p_e)


def test_a_host_to_device_copy_inside_the_step_is_refused():
    # No second device here: meta tensors stand for device memory.
    host = torch.ones(4)
    dev = torch.empty(4, device="meta")

    def step():
        dev.add_(host.to("meta"))  # PLANT-H2D

    err = _refusal(step)
    assert err.findings[0].kind == "host_to_device"
    assert err.findings[0].op == "aten._to_copy.default"
    assert f"{HERE}:{_line_of('PLANT-H2D')}" in str(err)


def test_host_work_inside_a_device_step_is_refused():
    dev = torch.empty(4, device="meta")
    host_counter = torch.zeros(())

    def step():
        dev.mul_(0.5)
        host_counter.add_(1)  # PLANT-HOST-WORK: a CUDA graph would run this once, at capture

    err = _refusal(step)
    assert [f.kind for f in err.findings] == ["host_work"]
    assert err.findings[0].op == "aten.add_.Tensor"
    assert f"{HERE}:{_line_of('PLANT-HOST-WORK')}" in str(err)
    # The same step over CPU tensors only is a CPU step: the host is its device.
    cpu, counter = torch.ones(4), torch.zeros(())
    g = capture.graph(lambda: (cpu.mul_(0.5), counter.add_(1)), warmup=0, backend="replay")
    g(), g()
    assert counter.item() == 2 and torch.equal(cpu, torch.full((4,), 0.25))


# --------------------------------------------------------------------------- RNG
def test_undeclared_rng_is_refused_and_declared_rng_replays():
    p = torch.zeros(4)

    def step():
        p.add_(torch.rand(4))  # PLANT-RNG

    err = _refusal(step)
    assert err.findings[0].kind == "rng" and err.findings[0].op == "aten.rand.default"
    assert f"{HERE}:{_line_of('PLANT-RNG')}" in str(err) and "allow_rng=True" in str(err)
    g = capture.graph(step, warmup=0, backend="replay", allow_rng=True)
    g(), g()
    assert g.captured and p.sum() > 0


# --------------------------------------------------------------------------- lazy initialisation
def _compiled_custom_op(name: str):
    """A torch.compile'd kernel inside a custom op (how graphstep records compiled kernels)."""
    @torch.compile(backend="eager", dynamic=False)
    def kernel(x):
        return x * 2 + 1

    @torch.library.custom_op(f"capture_strict_test::{name}", mutates_args=("x",))
    def op(x: torch.Tensor) -> None:
        x.copy_(kernel(x))

    return op


def test_a_first_compile_during_the_recording_is_refused_and_warm_up_fixes_it():
    op = _compiled_custom_op("first_compile_")
    p = torch.ones(3)
    err = _refusal(lambda: op(p))
    assert err.findings[0].kind == "lazy_init" and "torch.compile" in err.findings[0].op
    assert "warmup >= 1" in str(err)

    op2 = _compiled_custom_op("warmed_compile_")
    q = torch.ones(3)
    g = capture.graph(lambda: op2(q), warmup=1, backend="replay")
    g(), g(), g()  # warm-up compiles; the recording does not compile again; replays
    assert g.captured and torch.equal(q, torch.full((3,), 15.0))


def test_capture_check_runs_a_warmed_compiled_custom_op_without_compiling_it_again():
    # capture="auto" checks the step after its warm-up: the kernels compiled then must serve the check too
    # (the check's modes must not change what dynamo guards on), or every compiled kernel compiles twice.
    from capture.backends._strict import LazyInitWatch

    op = _compiled_custom_op("checked_compile_")
    p = torch.ones(3)
    op(p)  # the warm-up compiles
    with LazyInitWatch() as compiles:
        findings = capture.check(lambda: op(p))
    assert findings == [] and compiles.findings == []
    assert torch.equal(p, torch.full((3,), 7.0))


def test_a_compiled_kernel_that_would_recompile_at_a_replay_is_refused():
    # dynamo guards on the Python values a compiled kernel reads; a CUDA graph replays the captured kernel
    # whatever they become, so a guard miss during a replay must not pass as a silent recompile.
    holder = {"double": True}

    @torch.compile(backend="eager", dynamic=False)
    def kernel(x):
        return x * 2 if holder["double"] else x + 1

    @torch.library.custom_op("capture_strict_test::guarded_", mutates_args=("x",))
    def op(x: torch.Tensor) -> None:
        x.copy_(kernel(x))

    q = torch.ones(3)
    g = capture.graph(lambda: op(q), warmup=1, backend="replay")
    g(), g(), g()
    assert g.captured and torch.equal(q, torch.full((3,), 8.0))
    holder["double"] = False
    with pytest.raises(capture.CaptureError, match="compiled again during the replay") as refused:
        g()
    assert refused.value.findings[0].kind == "lazy_init"
    g.invalidate(warmup=1)
    g(), g(), g()  # the new variant compiles in the warm-up; captured again, replayed
    assert g.captured


def _first_collective_worker(_rank, _world_size):
    warnings.simplefilter("ignore")
    group = dist.new_group([0])
    t = torch.ones(2)
    g = capture.graph(lambda: dist.all_reduce(t, group=group), warmup=0, backend="replay")
    try:
        g()
        refused = None
    except capture.CaptureError as err:
        refused = str(err)
    warmed = capture.graph(lambda: dist.all_reduce(t, group=group), warmup=1, backend="replay")
    warmed(), warmed(), warmed()
    # graphstep's own collectives are functional ones, which name their group by a string
    functional = torch.ops._c10d_functional
    fresh = dist.new_group([0])
    g = capture.graph(lambda: functional.wait_tensor(functional.all_reduce_(t, "sum", fresh.group_name)),
                      warmup=0, backend="replay")
    try:
        g()
        functional_refused = None
    except capture.CaptureError as err:
        functional_refused = str(err)
    return refused, warmed.captured, functional_refused


@pytest.mark.distributed
def test_the_first_collective_on_a_group_during_the_recording_is_refused():
    # One gloo rank of its own: values() raises its traceback if it failed.
    [(refused, warmed_captured, functional_refused)] = values(spawn(_first_collective_worker, 1, timeout=90))
    assert refused is not None and "lazy_init" in refused
    assert "first collective on process group" in refused and "c10d.allreduce_" in refused
    assert warmed_captured
    assert functional_refused is not None and "first collective on process group" in functional_refused
    assert "_c10d_functional.all_reduce_" in functional_refused


def test_a_live_input_given_a_new_shape_at_the_same_address_is_refused_before_any_op():
    x = torch.ones(4)
    y = torch.zeros(4)

    def step():
        y.add_(x)

    g = capture.graph(step, warmup=0, backend="replay")
    g()
    x.data = x.data[:2]  # same data pointer, another shape: the graph would still read 4 elements
    before = y.clone()
    with pytest.raises(capture.StaleInputError, match="replaced after capture"):
        g()
    assert torch.equal(y, before)  # refused before any op ran
