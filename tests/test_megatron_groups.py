"""graphstep/plan/megatron_groups.py in one process: Megatron-Core is read from ``sys.modules``, never imported
(the groups themselves: tests/distributed/test_megatron_groups.py)."""

import ast
import sys
import types
from pathlib import Path

import torch

import graphstep as gs
from graphstep.plan import megatron_groups

ROOT = Path(__file__).resolve().parents[1]


def test_graphstep_never_imports_megatron():
    # A lazy import inside a function counts too: graphstep must run where megatron-core is not installed.
    offending = []
    for path in sorted((ROOT / "graphstep").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offending += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "megatron"]
    assert not offending


def test_an_uninitialised_or_absent_parallel_state_takes_no_group(monkeypatch):
    model = torch.nn.Linear(4, 4)
    model.weight.tensor_model_parallel, model.weight.partition_dim = True, 0
    named = list(model.named_parameters())
    config = gs.OptimizerConfig(capture="eager")
    monkeypatch.delitem(sys.modules, megatron_groups.PARALLEL_STATE, raising=False)
    assert megatron_groups.initialised_parallel_state() is None
    assert megatron_groups.from_parallel_state(config, named) == {}
    state = types.ModuleType(megatron_groups.PARALLEL_STATE)
    state.model_parallel_is_initialized = lambda: False
    monkeypatch.setitem(sys.modules, megatron_groups.PARALLEL_STATE, state)
    assert megatron_groups.from_parallel_state(config, named) == {}
    gs.get_optimizer(config, model)  # one process: the marks need no group
