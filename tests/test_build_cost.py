"""What a build costs beyond the bytes it must move: no second copy of the model while allocating, and a
probe of torch.compile that, shaped like the step's compiled call, compiles the variant the first step runs
(one compile in a process with a cold cache, not two). Structural checks only: no timing is asserted."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import graphstep as gs
from graphstep.kernels import auto, compiled


class _Copies(TorchDispatchMode):
    """The clones and copies dispatched inside the mode, with the shapes they wrote."""

    def __init__(self):
        super().__init__()
        self.clones, self.copies = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.clone.default:
            self.clones.append(tuple(args[0].shape))
        elif func is torch.ops.aten.copy_.default:
            self.copies.append(tuple(args[0].shape))
        return out


def test_build_copies_each_param_once_and_keeps_its_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))
    before = [p.detach().clone() for p in model.parameters()]
    with _Copies() as seen:
        gs.get_optimizer(gs.OptimizerConfig(optimizer="adam", lr=1e-3, kernel="fused"), model)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert [s for s in seen.clones if s in shapes] == [], "the build cloned the model's params"
    assert sorted(s for s in seen.copies if s in shapes) == sorted(shapes)  # one copy into the flat buffer each
    for p, value in zip(model.parameters(), before):
        assert torch.equal(p.detach(), value)


def _cut_pattern(numels: list[int]) -> list:
    """Per view, each part's (row width, single row or dynamic), and which dynamic row counts are equal."""
    parts = [[(width, (hi - lo) // width) for lo, hi, width in compiled._cuts(n)] for n in numels]
    dynamic = sorted({rows for view in parts for _, rows in view if rows > 1})
    return [[(width, rows if rows <= 1 else f"s{dynamic.index(rows)}") for width, rows in view] for view in parts]


def test_stand_ins_cut_like_the_views_they_stand_for():
    cases = [[10420224, 20736], [197, 7], [64, 65, 1, 130, 128 * 64 + 3], [4096] * 5 + [4160], [63, 2, 64 * 9]]
    for numels in cases:
        small = auto.stand_in_numels(numels)
        assert _cut_pattern(small) == _cut_pattern(numels), numels
        assert sum(small) <= sum(numels) and all(s <= 64 * 64 for s in small)
    many = [64 * (2 + i) for i in range(80)]  # more distinct row counts than a tail could stand in for
    assert auto.stand_in_numels(many) == many


def test_probe_shaped_like_the_step_leaves_the_first_step_nothing_to_compile(monkeypatch):
    monkeypatch.setattr(auto, "_probed", {})
    monkeypatch.setattr(auto, "_remembered", lambda device, hyper_dtype: False)
    monkeypatch.setattr(auto, "_remember", lambda device, hyper_dtype: None)
    flat = {name: torch.randn(64 * 41 + 64 * 9 + 5) for name in ("param", "grad", "exp_avg", "exp_avg_sq")}
    flat["exp_avg_sq"].abs_()
    cut = [(0, 64 * 41), (64 * 41, 64 * 50 + 5)]  # two groups, one view each, the second with a tail
    like = auto.step_shape([_Segment(0, 0, 64 * 41), _Segment(1, 64 * 41, 64 * 50 + 5)], [0, 1], decoupled=True,
                           scaled=True)
    works, why_not, _ = auto.probe_compiled(torch.device("cpu"), torch.float64, like=like)
    assert works, why_not
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    groups = [tuple([flat[name][lo:hi]] for name in ("param", "grad", "exp_avg", "exp_avg_sq"))
              + ({name: torch.tensor(value, dtype=torch.float64) for name, value in
                  dict(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8).items()},) for lo, hi in cut]
    compiled.adam_groups(groups, step=torch.ones(()), decoupled=True, grad_scale=torch.full((), 2.0),
                         found_inf=torch.zeros(()))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "the step compiled a variant of its own"


class _Segment:
    """The fields of plan.layout.Segment that ``auto.step_shape`` reads."""

    def __init__(self, group: int, start: int, end: int):
        self.group, self.numel = group, end - start
