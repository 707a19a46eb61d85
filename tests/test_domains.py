"""Dense and expert params are two instances of one ``Domain`` (graphstep/step/domains.py): the code that runs over
them iterates ``opt.domains`` instead of asking whether there are experts. Read from the sources (like
tests/test_layering.py), so a new ``experts is None`` branch anywhere in the library fails here. The expert
domain's behaviour itself (results, checkpoints, memory stats, stage names against one process):
tests/distributed/test_expert_parallel.py."""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import graphstep as gs
from graphstep.step import domains

ROOT = Path(__file__).resolve().parents[1]
# The domain module decides which domains exist; everything else iterates them.
EXEMPT = {Path("graphstep/step/domains.py")}
# Names under which the library held the expert domain (or its context, or its group) before domains.
EXPERT_NAMES = {"experts", "expert", "expert_ctx", "expert_domain", "expert_group"}


def _terminal_name(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def expert_branches(path: Path, root: Path = ROOT) -> list[str]:
    """Every place in ``path`` that special-cases the expert domain: an ``is None`` / ``is not None`` test of
    an expert-named value, a read of an ``.experts`` attribute (``opt.experts``: the convenience is for tests
    and tools), ``getattr(x, "experts")``, or the old ``expert_ctx``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) \
                and any(isinstance(c, ast.Constant) and c.value is None for c in node.comparators) \
                and _terminal_name(node.left) in EXPERT_NAMES:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr == "experts":
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and _terminal_name(node.func) == "getattr" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value == "experts":
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id == "expert_ctx":
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_expert_branch_outside_the_domain_module():
    sources = [p for p in sorted((ROOT / "graphstep").rglob("*.py")) if p.relative_to(ROOT) not in EXEMPT]
    assert len(sources) > 30  # the scan sees the library
    found = [hit for path in sources for hit in expert_branches(path)]
    assert not found, "iterate opt.domains (graphstep/step/domains.py) instead of special-casing experts:\n" + \
        "\n".join(found)


def test_the_scan_catches_each_kind_of_branch(tmp_path):
    """The scan is not vacuous: each pattern it exists for is reported."""
    source = tmp_path / "branches.py"
    source.write_text("def f(opt, experts=None, expert_ctx=None):\n"
                      "    a = [opt.buffers] if opt.experts is None else []\n"
                      "    if experts is not None:\n"
                      "        pass\n"
                      "    b = getattr(opt, 'experts', None)\n"
                      "    return expert_ctx\n")
    found = expert_branches(source, root=tmp_path)
    lines = sorted({int(hit.split(":")[1]) for hit in found})
    assert lines == [2, 3, 5, 6], found


def _engine():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return gs.get_optimizer(gs.OptimizerConfig(optimizer="sgd", lr=0.1, capture="eager"), model)


def test_an_engine_without_experts_has_one_dense_domain_and_the_conveniences_read_it():
    opt = _engine()
    (dense,) = opt.domains
    assert dense.role is domains.DENSE and opt.experts is None
    assert opt.buffers is dense.buffers and opt.layout is dense.layout and opt.comm is dense.comm
    assert dense.ctx.buffers is dense.buffers and dense.rank == opt.rank == 0
    with pytest.raises(AttributeError):
        opt.buffers = dense.buffers  # read-only: the domains are the one place the buffers live


def test_a_domain_names_its_stages_and_buffers_by_its_role():
    opt = _engine()
    dense = opt.domains[0]
    expert = domains.Domain(domains.EXPERTS, dense.layout, dense.buffers, dense.comm, dense.ctx)
    stage = opt.stages[0]
    assert dense.named(stage).name == stage.name
    assert expert.named(stage).name == f"expert_{stage.name}" and expert.named(stage).apply is stage.apply
    assert set(expert.addresses()) == {f"expert {name}" for name in dense.addresses()}
    assert domains.with_role((dense, expert), domains.EXPERTS) is expert


def test_the_reshardable_format_refuses_a_domain_it_does_not_cover():
    opt = _engine()
    dense = opt.domains[0]
    view = opt.checkpoint_view()
    domains.refuse_checkpoint(view, "sharded_state_dict")  # the dense domain is covered

    with_experts = dataclasses.replace(
        view, domains=(dense, domains.Domain(domains.EXPERTS, dense.layout, dense.buffers, dense.comm, dense.ctx)))
    with pytest.raises(NotImplementedError, match="does not cover expert params"):
        domains.refuse_checkpoint(with_experts, "sharded_state_dict")
