"""graphstep/native: the pre-step checks' per-param reads, compiled and in Python, give the same answers.

Every case runs both ways: the compiled library (built here if the cache lacks it; the test waits for it)
and the Python fallback (within ``build.python_only()``, as where no compiler is found). A third check
starts a fresh interpreter with the library disabled, or with a compiler that fails, and reads its status.
"""

import fcntl
import os
import subprocess
import sys

import pytest
import torch

import graphstep as gs
from graphstep.native import build, param_checks

N = 40


@pytest.fixture(scope="module")
def compiled():
    module = build.wait(timeout=600)
    if module is None and "no C++ compiler" in build.status():
        pytest.skip(build.status())  # the cases' Python half runs all the same
    assert module is not None, build.status()
    assert build.status().startswith("native: ")
    return module


@pytest.fixture(params=["native", "python"])
def way(request):
    if request.param == "python":
        with build.python_only():
            assert build.loaded() is None
            yield request.param
    else:
        compiled = request.getfixturevalue("compiled")
        assert build.loaded() is compiled
        yield request.param


def _bound(n=N):
    """n params viewing one flat buffer, each with a grad viewing another: what the engine binds."""
    flat, grads = torch.zeros(n * 8), torch.zeros(n * 8)
    params = [torch.nn.Parameter(torch.empty(8)) for _ in range(n)]
    views = []
    for i, p in enumerate(params):
        p.data = flat[i * 8:(i + 1) * 8]
        views.append(grads[i * 8:(i + 1) * 8])
        p.grad = views[-1]
    return params, views, param_checks.int64s(p.data_ptr() for p in params)


def _versions(tensors):
    return param_checks.int64s(t._version for t in tensors)


def test_an_untouched_binding_reads_as_unchanged(way):
    params, views, ptrs = _bound()
    assert param_checks.first_unbound(params, data_ptrs=ptrs, grads=views, requires_grad=True) == -1
    assert param_checks.first_unbound(params) == -1  # nothing asked, nothing found
    assert param_checks.first_other_version(params, _versions(params)) == -1
    assert param_checks.first_unbound([], data_ptrs=param_checks.int64s([]), grads=[], requires_grad=False) == -1


@pytest.mark.parametrize("change", ["data replaced", "grad None", "grad replaced", "grad a new view, same memory",
                                    "old grad kept elsewhere", "frozen"])
def test_the_first_changed_param_is_found(way, change):
    params, views, ptrs = _bound()
    kept = []
    for i in (7, 23):
        p = params[i]
        if change == "data replaced":
            p.data = torch.zeros(8)
        elif change == "grad None":
            p.grad = None
        elif change == "grad replaced":
            p.grad = torch.zeros(8)
        elif change == "grad a new view, same memory":
            p.grad = views[i].view(8)
        elif change == "old grad kept elsewhere":
            kept.append(p.grad)  # the old grad lives on: its storage's and its object's counts do not move
            p.grad = torch.zeros(8)
        else:
            p.requires_grad_(False)
    expectations = {"data_ptrs": ptrs, "grads": views, "requires_grad": True}
    assert param_checks.first_unbound(params, **expectations) == 7
    assert param_checks.first_unbound(params[8:], data_ptrs=param_checks.int64s(ptrs[8:]), grads=views[8:],
                                      requires_grad=True) == 15
    # Each expectation checks its own attribute only.
    checked = {"data replaced": "data_ptrs", "frozen": "requires_grad"}.get(change, "grads")
    for name, value in expectations.items():
        assert param_checks.first_unbound(params, **{name: value}) == (7 if name == checked else -1)
    # A grad expected None is not checked.
    assert param_checks.first_unbound(params, grads=[None if i in (7, 23) else v for i, v in enumerate(views)]) == -1


def test_a_param_swapped_with_another_tensor_is_found(way):
    # torch.utils.swap_tensors (what nn.Module.to does for DTensor params, or for any with
    # torch.__future__.set_swap_module_params_on_conversion) gives a param's Python object another TensorImpl:
    # the checks must read through the object each time, never keep its TensorImpl.
    params, views, ptrs = _bound()
    other = torch.nn.Parameter(torch.zeros(8))
    torch.utils.swap_tensors(params[9], other)
    del other  # the param's old TensorImpl goes with it
    assert param_checks.first_unbound(params, data_ptrs=ptrs, grads=views, requires_grad=True) == 9


def test_versions_are_read_per_param(way):
    params, _, _ = _bound()
    versions = _versions(params)
    with torch.no_grad():
        params[12].mul_(2)
    assert param_checks.first_other_version(params, versions) == 12
    versions[12] += 1
    assert param_checks.first_other_version(params, versions) == -1


class _Traced(torch.Tensor):
    """A subclass whose ``__torch_function__`` would answer attribute reads: the checks read the tensor's own."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"{func} dispatched")


def test_a_tensor_subclass_is_read_without_its_torch_function(way):
    params, views, ptrs = _bound(4)
    subclassed = [p.detach().as_subclass(_Traced) for p in params]
    with torch._C.DisableTorchFunctionSubclass():
        subclassed[2].requires_grad_(True)
        subclassed[2].grad = views[2]
    assert param_checks.first_unbound(subclassed, data_ptrs=ptrs) == -1
    assert param_checks.first_unbound(subclassed, requires_grad=False) == 2
    assert param_checks.first_unbound(subclassed, grads=[None, None, views[2], None]) == -1
    assert param_checks.first_other_version(subclassed, _versions(params)) == -1


def test_bad_arguments_are_refused_alike(way):
    params, views, ptrs = _bound(3)
    with pytest.raises(ValueError, match="as long as tensors"):
        param_checks.first_unbound(params, data_ptrs=param_checks.int64s(ptrs[:2]))
    with pytest.raises(ValueError, match="as long as tensors"):
        param_checks.first_unbound(params, grads=views[:2])
    with pytest.raises(ValueError, match="as long as tensors"):
        param_checks.first_other_version(params, _versions(params[:2]))
    with pytest.raises(TypeError):
        param_checks.first_unbound([params[0], "x"], data_ptrs=param_checks.int64s(ptrs[:2]))


class _Holder:
    """An object holding a tensor as an attribute, as FSDP2's FSDPParam holds its sharded data."""

    def __init__(self, tensor):
        self.data = tensor


def test_the_tensors_may_be_an_attribute_of_each_object(way):
    params, views, ptrs = _bound()
    holders = [_Holder(p) for p in params]
    assert param_checks.first_unbound(holders, data_ptrs=ptrs, grads=views, requires_grad=True, attribute="data") == -1
    holders[11].data = torch.zeros(8)  # the holder now points at other memory: FSDP2's data moved
    assert param_checks.first_unbound(holders, data_ptrs=ptrs, attribute="data") == 11
    assert param_checks.first_unbound(holders, grads=views, attribute="data") == 11  # its grad is not the view
    assert param_checks.first_unbound(holders[12:], data_ptrs=param_checks.int64s(ptrs[12:]), attribute="data") == -1


def test_a_missing_or_non_tensor_attribute_is_refused_alike(way):
    params, _, ptrs = _bound(3)
    holders = [_Holder(p) for p in params]
    with pytest.raises(AttributeError):
        param_checks.first_unbound(holders, data_ptrs=ptrs, attribute="other")
    holders[1].data = "x"
    with pytest.raises(TypeError, match=r"tensors\[1\] is not a tensor"):
        param_checks.first_unbound(holders, data_ptrs=ptrs, attribute="data")
    with pytest.raises(TypeError, match="attribute must be a str"):
        param_checks.first_unbound(holders, data_ptrs=ptrs, attribute=3)


def _trained(replace: bool, torn: str):
    """Two steps of a small model where, before the second, ``torn`` ("grad" or "param") of its first weight
    gets new values: replaced by a new tensor (``replace``), or written in place, which needs no check."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=0.1, kernel="fused", capture="eager"), model)
    weight = model[0].weight
    for step in range(2):
        model(torch.randn(4, 6)).square().sum().backward()
        if step == 1:
            values = torch.linspace(-1, 1, weight.numel()).view_as(weight)
            tensor = weight.grad if torn == "grad" else weight.data
            if replace and torn == "grad":
                weight.grad = values.clone()
            elif replace:
                weight.data = values.clone()
            else:
                tensor.copy_(values)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("torn", ["grad", "param"])
def test_the_step_takes_back_a_replaced_grad_or_param(way, torn):
    in_place = _trained(replace=False, torn=torn)
    replaced = _trained(replace=True, torn=torn)
    assert all(torch.equal(a, b) for a, b in zip(in_place, replaced))


def test_the_step_refuses_a_param_frozen_after_the_build(way):
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=0.1, kernel="fused", capture="eager"), model)
    model(torch.randn(4, 6)).sum().backward()
    model[1].bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match="'1.bias' do not require grad"):
        opt.step()


def _status_in_a_fresh_process(env: dict) -> str:
    code = "from graphstep.native import build; build.wait(600); print(build.status())"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_disabled_or_unbuildable_leaves_the_checks_in_python(tmp_path):
    assert _status_in_a_fresh_process({build.DISABLE_VARIABLE: "0"}) == f"python: {build.DISABLE_VARIABLE}=0"
    # An empty cache and a compiler that fails: the status says so, and nothing half-written is left.
    failing = _status_in_a_fresh_process({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "CXX": "false"})
    assert failing.startswith("python: the native checks could not be built (RuntimeError: false exited 1")
    assert not list((tmp_path / "graphstep_native").glob("*.so"))
    assert not list((tmp_path / "graphstep_native").glob("*.partial"))


def test_a_process_that_exits_while_compiling_leaves_the_library_built(tmp_path):
    # The first process starts the build and exits as soon as its compiler runs (as a test's rank may); the
    # compiler finishes and publishes the library, and the next process loads that one after waiting on the lock.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    folder = tmp_path / "graphstep_native"
    leave = ("import os, pathlib, time; from graphstep.native import build; build.loaded()\n"
             f"while not list(pathlib.Path({str(folder)!r}).glob('*.partial')): time.sleep(0.05)\n"
             "os._exit(0)")
    subprocess.run([sys.executable, "-c", leave], env=env, timeout=120, check=True)
    assert list(folder.glob("*.partial")) and not list(folder.glob("*.so"))  # still compiling
    (lock,) = folder.glob("*.lock")
    with open(lock) as handle, pytest.raises(BlockingIOError):  # held by the compiler's shell: B waits
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert _status_in_a_fresh_process({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}).startswith("native: ")
    assert len(list(folder.glob("*.so"))) == 1 and not list(folder.glob("*.partial"))
