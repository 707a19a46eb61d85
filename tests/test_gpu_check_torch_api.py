"""The GPU check's list of private torch names (perf/gpu_check_torch_api.py) stays true.

The GPU machine brings its own torch; its preflight names every private torch attribute, op or option graphstep
uses that this torch lacks. That only helps while the list holds every private name the sources use: a scan of
graphstep/ and capture/ finds them (attribute accesses and imports whose name starts with ``_``, the ops of an
aliased op namespace, the members read off FSDP2's ``FSDPParam``, inductor and dynamo option names).
"""

import ast
import importlib.util
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for folder in ("graphstep", "capture") for p in sorted((ROOT / folder).rglob("*.py"))]


@pytest.fixture(scope="module")
def api():
    spec = importlib.util.spec_from_file_location("gpu_check_torch_api", ROOT / "perf" / "gpu_check_torch_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def scan():
    """(private attribute names read off objects the sources do not define them on, private torch paths the
    sources import or spell out, ops read off an alias of ``torch.ops.<namespace>``, members read off
    ``fsdp_param``, keywords of ``config.patch(...)``), each with the files that use it."""
    defined, attrs, paths, fsdp, patched = set(), defaultdict(set), defaultdict(set), defaultdict(set), defaultdict(set)
    for path in SOURCES:
        tree, where = ast.parse(path.read_text()), str(path.relative_to(ROOT))
        aliases = {}  # name -> "torch.ops._namespace"
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                value = _dotted(node.value) or ""
                if value.startswith("torch.ops."):
                    aliases[node.targets[0].id] = value
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                for alias in node.names:
                    if any(map(_private, node.module.split("."))) or _private(alias.name):
                        paths[f"{node.module}.{alias.name}"].add(where)
            elif isinstance(node, ast.Call) and (_dotted(node.func) or "").endswith("config.patch"):
                for keyword in node.keywords:
                    patched[keyword.arg].add(where)
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if isinstance(node.ctx, ast.Store) and owner in ("self", "cls"):
                defined.add(node.attr)
            if _private(node.attr) and owner not in ("self", "cls"):
                attrs[node.attr].add(where)
            if owner == "fsdp_param":
                fsdp[node.attr].add(where)
            if owner in aliases and (_private(node.attr) or any(map(_private, aliases[owner].split(".")))):
                paths[f"{aliases[owner]}.{node.attr}"].add(where)
            dotted = _dotted(node) or ""
            if dotted.startswith("torch.") and any(map(_private, dotted.split(".")[1:])):
                paths[dotted].add(where)
    return {k: v for k, v in attrs.items() if k not in defined}, paths, fsdp, patched


def _listed(api) -> set:
    names = set(api.NAMES) | set(api.OPTIONAL) | {f"{cls}.{m}" for cls, members in api.MEMBERS.items()
                                                  for alternatives in members for m in alternatives.split("|")}
    return names | {f"torch._inductor.config.{o}" for o in api.INDUCTOR_OPTIONS} \
        | {f"torch._dynamo.config.{o}" for o in api.DYNAMO_OPTIONS}


def test_every_private_torch_name_the_sources_use_is_listed(api):
    attrs, paths, fsdp, patched = scan()
    listed = _listed(api)
    parts = {part for name in listed for part in name.split(".")}
    unlisted_attrs = {a: sorted(w) for a, w in attrs.items() if a not in parts and a not in api.NOT_TORCH}
    # a spelled-out path is covered when it is listed or leads to a listed name (``torch._C`` on the way)
    unlisted_paths = {p: sorted(w) for p, w in paths.items()
                      if not any(n == p or n.startswith(p + ".") for n in listed)}
    fsdp_members = {m for ms in api.MEMBERS[next(c for c in api.MEMBERS if c.endswith(".FSDPParam"))]
                    for m in ms.split("|")}
    unlisted_fsdp = {m: sorted(w) for m, w in fsdp.items() if m not in fsdp_members}
    unlisted_options = {o: sorted(w) for o, w in patched.items() if o not in api.DYNAMO_OPTIONS}
    assert (unlisted_attrs, unlisted_paths, unlisted_fsdp, unlisted_options) == ({}, {}, {}, {}), \
        "add these to perf/gpu_check_torch_api.py so the GPU check's preflight checks them"


def test_the_inductor_options_graphstep_compiles_with_are_listed(api):
    from graphstep.kernels import compiled

    used = set(compiled.compile_options("cpu")) | set(compiled.compile_options("cuda"))
    assert used <= set(api.INDUCTOR_OPTIONS), used - set(api.INDUCTOR_OPTIONS)


def test_this_torch_has_every_listed_name(api):
    assert api.problems() == {}
    assert set(api.optional_missing()) <= set(api.OPTIONAL)  # graphstep does without these (torch 2.11 lacks one)
    assert len(set(api.NAMES)) == len(api.NAMES)  # no name listed twice, so the count the preflight states is true
    assert api.count() == len(api.NAMES) + len(api.OPTIONAL) + sum(map(len, api.MEMBERS.values())) \
        + len(api.INDUCTOR_OPTIONS) + len(api.DYNAMO_OPTIONS)


def test_a_renamed_member_is_present_when_either_name_is(api, monkeypatch):
    monkeypatch.setattr(api, "NAMES", ())
    monkeypatch.setattr(api, "MEMBERS", {"torch.nn.Module": ("_no_such_member|_parameters",)})
    assert api.problems() == {}
    monkeypatch.setattr(api, "MEMBERS", {"torch.nn.Module": ("_no_such_member|_nor_this",)})
    assert set(api.problems()) == {"torch.nn.Module._no_such_member|_nor_this"}


def test_a_missing_optional_name_is_reported_not_failed(api, monkeypatch):
    before = set(api.problems())
    monkeypatch.setattr(api, "OPTIONAL", {"torch._C._no_such_getter": "something is not seen"})
    assert set(api.problems()) == before
    assert api.optional_missing() == {"torch._C._no_such_getter": "something is not seen"}


def test_a_missing_name_is_named(api, monkeypatch):
    before = set(api.problems())  # empty where this torch has every name (the test above says so)
    monkeypatch.setattr(api, "NAMES", api.NAMES + ("torch._C._no_such_function", "torch.ops.aten._no_such_op"))
    monkeypatch.setattr(api, "MEMBERS", {**api.MEMBERS, "torch.nn.Module": ("_parameters", "_no_such_member")})
    monkeypatch.setattr(api, "INDUCTOR_OPTIONS", api.INDUCTOR_OPTIONS + ("no_such_option",))
    assert set(api.problems()) - before == {"torch._C._no_such_function", "torch.ops.aten._no_such_op",
                                            "torch.nn.Module._no_such_member", "torch._inductor.config.no_such_option"}
