"""The package's layers, read from the sources (a lazy import inside a function counts too; an import under
``if TYPE_CHECKING:`` does not, as it never runs).

capture/ imports nothing from graphstep (docs/design.md §2, law 6): it captures any callable over static
tensors, and graphstep depends on it, never the reverse. Inside graphstep each folder imports only the
folders below it (``ALLOWED``), no module takes part in an import circle, and no library module reads an
optimizer's private attributes or its parts: the engine passes the parts a module needs. Tests and perf scripts
read no private attribute of an object: they use the public API, or the build record through
``opt.build_record``."""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def _is_source_module(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imported_modules(path: Path) -> set:
    """Every module ``path`` imports at run time, relative imports resolved: ``from p import x`` names the
    module ``p.x`` where there is one in this repository, else ``p``."""
    package = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]
    names = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                names.add(submodule if _is_source_module(submodule) else module)
    return names


def test_capture_imports_nothing_from_graphstep():
    sources = sorted((ROOT / "capture").rglob("*.py"))
    assert sources
    offending = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m.split(".")[0] == "graphstep")
                 for p in sources}
    assert not {p: m for p, m in offending.items() if m}


def test_the_library_never_imports_the_app():
    # graphstep/__main__.py is ``python -m graphstep``: the command line's entry, part of the app.
    sources = [p for p in sorted((ROOT / "graphstep").rglob("*.py"))
               if "app" not in p.relative_to(ROOT).parts and p.name != "__main__.py"]
    offending = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m.startswith("graphstep.app"))
                 for p in sources}
    assert not {p: m for p, m in offending.items() if m}


def test_the_library_names_no_accelerator_type():
    # docs/design.md law 7: capture.devices decides what a device gets; "cpu" (host memory) is allowed.
    sources = [p for p in sorted((ROOT / "graphstep").rglob("*.py")) if "app" not in p.relative_to(ROOT).parts]
    found = {}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("cuda"):
                found.setdefault(str(path.relative_to(ROOT)), []).append(node.value)
    assert not found


# Each folder of graphstep/ and the folders it may import, bottom to top: what the step needs at build time
# (config, families, kernels, fp8, parallel, and the native helpers) under the plan (plan), the storage (state), the step's math
# (step), the model hooks (hooks), running it (run) and the optional layers that span them (offload,
# checkpoint). The top-level modules (engine, wrap, scheduler, the public qk_clip) and the app may import
# any of them.
_BUILD_INPUTS = {"config", "families", "kernels", "fp8", "parallel", "native"}
ALLOWED = {
    "native": set(),
    "kernels": {"native"},
    "fp8": set(),
    "parallel": set(),
    "families": {"kernels"},
    "config": {"families", "kernels"},
    "plan": _BUILD_INPUTS,
    "state": _BUILD_INPUTS | {"plan"},
    "step": _BUILD_INPUTS | {"plan", "state"},
    "hooks": _BUILD_INPUTS | {"plan", "state", "step"},
    "run": _BUILD_INPUTS | {"plan", "state", "step", "hooks"},
    "offload": _BUILD_INPUTS | {"plan", "state", "step", "hooks", "run"},
    "checkpoint": _BUILD_INPUTS | {"plan", "state", "step", "hooks", "run"},
    # The engine for FSDP2 models subclasses the engine's: the one folder above it (graphstep/factory.py picks).
    "fsdp2": _BUILD_INPUTS | {"plan", "state", "step", "hooks", "run", "checkpoint", "engine", "assembly"},
    # The whole iteration as one graph: the optimizer's pre-step checks and stages, around the user's model.
    "iteration": _BUILD_INPUTS | {"plan", "state", "step", "hooks", "run", "pre_step"},
}


def _library_modules() -> dict:
    """Every module of graphstep/ by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted((ROOT / "graphstep").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_folder_of_the_library_has_a_layer():
    folders = {p.name for p in (ROOT / "graphstep").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - {"app"} == set(ALLOWED)


def test_each_folder_imports_only_the_layers_below_it():
    modules = _library_modules()
    offending = {}
    for name, path in modules.items():
        folder = _folder(name)
        if folder not in ALLOWED:
            continue
        reached = {_folder(m) for m in imported_modules(path) if m.split(".")[0] == "graphstep"} - {folder}
        if reached - ALLOWED[folder]:
            offending[name] = sorted(reached - ALLOWED[folder])
    assert not offending


def test_no_import_circle():
    modules = _library_modules()
    graph = {name: {m for m in imported_modules(path) if m in modules and m != name} for name, path in modules.items()}
    circles = [sorted(component) for component in _strongly_connected(graph) if len(component) > 1]
    assert not circles


def _strongly_connected(graph: dict) -> list:
    """Tarjan's algorithm, iterative: the strongly connected components of ``graph``."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
    return components


def test_no_library_module_reads_an_optimizers_private_attributes():
    # The engine is the façade: it passes its parts to the modules that need them (memory stats, debug step,
    # checkpoints), so its private attributes stay its own.
    found = {}
    for name, path in _library_modules().items():
        if name == "graphstep.engine":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in {"opt", "optimizer", "engine"}):
                found.setdefault(name, []).append(node.attr)
    assert not found


# ---- the engine as a façade over its build record, and small files ---------------------------------------------
def _record_parts() -> set:
    """The parts of an engine: its build record's fields (graphstep/assembly.py ``Build``) and the conveniences the
    engine derives from them (the dense domain's ``layout`` and ``buffers``, the ``experts`` domain)."""
    tree = ast.parse((ROOT / "graphstep" / "assembly.py").read_text())
    record = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Build")
    fields = {node.target.id for node in record.body if isinstance(node, ast.AnnAssign)}
    assert {"buffers", "domains", "tensors", "scaler", "comm", "runner"} - fields == {"buffers"}
    return fields | {"layout", "buffers", "experts"}


# The façades hold the record; the app (like the tests) is a user of their public read-only attributes.
_FACADES = {"graphstep.engine", "graphstep.fsdp2.optimizer", "graphstep.wrap"}
# Modules that take the whole optimizer and read its parts, with why.
_READ_OPTIMIZER_PARTS = {
    "graphstep.iteration.iteration": "graphstep.Iteration is handed the user's optimizer and reads what a user reads "
                                     "(device, config, result); the engine's parts come from iteration_parts()",
}


def test_no_module_outside_the_facades_reads_the_optimizer_for_its_parts():
    # ``opt.buffers``, ``optimizer.domains``, ...: a module that needs parts of the engine is handed them by the
    # engine (graphstep/engine.py passes the record's parts), so what it reads is in its signature.
    parts, found = _record_parts(), {}
    for name, path in _library_modules().items():
        if name in _FACADES or name in _READ_OPTIMIZER_PARTS or _folder(name) == "app":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in parts and isinstance(node.value, ast.Name)
                    and node.value.id in {"opt", "optimizer", "engine"}):
                found.setdefault(name, []).append(node.attr)
    assert not found


def test_the_allowed_readers_of_optimizer_parts_still_exist():
    modules = _library_modules()
    assert not [name for name in _READ_OPTIMIZER_PARTS if name not in modules]


MAX_LINES = 400


def test_no_source_file_is_over_400_lines():
    sources = sorted((ROOT / "graphstep").rglob("*.py")) + sorted((ROOT / "capture").rglob("*.py"))
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long


# ---- tests and perf scripts use the public API, or the build record through ``opt.build_record`` ---------------
def test_the_engine_keeps_no_private_aliases_of_its_record():
    # Tools and tests read the record through the one documented accessor, ``opt.build_record``.
    from graphstep.engine import GraphstepOptimizer
    from graphstep.fsdp2.optimizer import Fsdp2Optimizer

    aliases = [name for cls in (GraphstepOptimizer, Fsdp2Optimizer) for name, value in vars(cls).items()
               if name.startswith("_") and not name.startswith("__") and (isinstance(value, property)
                                                                           or name.lstrip("_") in _record_parts())]
    assert not aliases


# Private attributes a test or perf script may read on an object, by name: other libraries' own (what graphstep's
# tests inspect to see what graphstep did to them), and graphstep's internals no public reader offers yet.
_PRIVATE_READS_ALLOWED = {
    "_local_tensor": "torch's DTensor: the local shard a rank holds, what FSDP2's tests compare",
    "_version": "torch's Tensor version counter: what graphstep/native's version check must read alike",
    "_forward_hooks": "torch's nn.Module hook dicts: tests check graphstep's hooks are installed and removed",
    "_forward_pre_hooks": "torch's nn.Module hook dicts (as above)",
    "_backward_hooks": "torch's Tensor hook dict (as above)",
    "_post_accumulate_grad_hooks": "torch's Tensor hook dict (as above)",
    "_state_dict_hooks": "torch's nn.Module state-dict hooks (as above)",
    "_parameters": "torch's nn.Module param dict: a test replaces a param behind nn.Module's back",
    "_actions": "argparse's parser actions: the CLI tests walk every option (argparse lists them nowhere else)",
    "_scale_inv": "TransformerEngine's Float8Tensor scale, compared with graphstep's",
    "_clip_linear_qkv": "Megatron-Core's SelfAttention method, bound onto a stand-in layer by the parity test",
    "_reset_state": "accelerate's AcceleratorState, reset between tests",
    "_get_param_groups": "Megatron-Core's param grouping: the oracle the parity test compares graphstep's with",
    # graphstep's own, with no public reader yet.
    "_graphs": "graphstep.Iteration's graphs by input signature (replays, shapes): no public reader yet",
    "_backend": "capture/'s Graph's backend, read by capture/'s own tests and the iteration benchmark",
    "_program": "capture/'s replay backend's recorded program (op counts), as above",
    "_options": "capture/'s CUDA backend's options, as above",
    "_graph": "capture/'s CUDA backend's graph (None after close), as above",
    "_stream": "capture/'s CUDA backend's stream (None after close), as above",
    "_pool": "capture/'s CUDA backend's memory pool (None after close), as above",
}


def _private_reads(path: Path) -> list:
    """(line, expression) of every private attribute read on an object in ``path``: not on a module or a name
    the file imports (a module's private helpers are another matter), nor on the file's own ``self``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {alias.asname or alias.name for alias in node.names}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in _PRIVATE_READS_ALLOWED):
            continue
        root = node.value
        while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
            root = root.func if isinstance(root, ast.Call) else root.value
        name = root.id if isinstance(root, ast.Name) else None
        if name in imported or name == "self" or _is_module_local(tree, name, imported):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def _is_module_local(tree: ast.AST, name, imported: set) -> bool:
    """``name`` is bound to a module: ``pytest.importorskip(...)``, or a module's attribute (``torch.ops.aten``)."""
    def module_like(value: ast.AST) -> bool:
        if isinstance(value, ast.Call):
            return ast.unparse(value.func) in ("pytest.importorskip", "importlib.import_module")
        while isinstance(value, ast.Attribute):
            value = value.value
        return isinstance(value, ast.Name) and value.id in imported

    return any(isinstance(node, ast.Assign) and module_like(node.value)
               and any(isinstance(t, ast.Name) and t.id == name for t in node.targets) for node in ast.walk(tree))


def test_no_test_or_perf_file_reads_a_private_attribute_of_an_object():
    # ``opt._fold``: a test reads what a user could, or the build record through ``opt.build_record``.
    sources = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "perf").rglob("*.py"))
    found = {str(p.relative_to(ROOT)): reads for p in sources if (reads := _private_reads(p))}
    assert not found


def test_the_allowed_private_reads_are_still_made():
    sources = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "perf").rglob("*.py"))
    text = "\n".join(p.read_text() for p in sources)
    assert not [name for name in _PRIVATE_READS_ALLOWED if f".{name}" not in text]


# ---- lean docstrings: a module says what it is for and why; figures live in docs/performance.md ----------------
MAX_MODULE_DOCSTRING_LINES = 15

# A measured figure: a time, a speed ratio, a bandwidth, a percentage.
_FIGURE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?\s?(?:ms|µs|us|ns|s|seconds|GB/s|GiB/s|MB/s|%)(?![\w/])"
                     r"|(?<![\w.])\d+(?:\.\d+)?\s?(?:×|x\b)(?!\s*\d)|\btimes (?:slower|faster)\b")

# Numbers that match ``_FIGURE`` but are contracts, not measurements: (file, the matched text) -> why.
_FIGURES_ALLOWED = {
    ("graphstep/app/bench_rows.py", "95%"): "the bootstrap interval's confidence level, a parameter",
    ("graphstep/app/demo.py", "10%"): "the margin estimate_seconds adds for the optimizer step, a constant",
}


def _library_sources() -> list:
    return sorted((ROOT / "graphstep").rglob("*.py")) + sorted((ROOT / "capture").rglob("*.py"))


def _prose(path: Path):
    """(line, text) of every docstring and comment line of ``path``."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if (doc := ast.get_docstring(node, clean=False)) is not None:
                yield from enumerate(doc.splitlines(), node.body[0].lineno)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def test_no_module_docstring_is_an_essay():
    long = {}
    for path in _library_sources():
        name = str(path.relative_to(ROOT))
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(doc.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            long[name] = len(doc.splitlines())
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines: say what the module is for and why"


def test_no_docstring_or_comment_holds_a_measured_figure_or_an_outside_file():
    found = []
    for path in _library_sources():
        name = str(path.relative_to(ROOT))
        for line, text in _prose(path):
            found += [f"{name}:{line}: {m.group(0)!r} in {text.strip()!r}" for m in _FIGURE.finditer(text)
                      if (name, m.group(0)) not in _FIGURES_ALLOWED]
            if "shared/reference" in text:
                found.append(f"{name}:{line}: cites a file outside the repository")
    assert not found, "measured figures belong in docs/performance.md:\n" + "\n".join(found)


def test_the_docstring_allow_lists_are_still_needed():
    sources = {str(p.relative_to(ROOT)) for p in _library_sources()}
    assert not [name for name, _ in _FIGURES_ALLOWED if name not in sources]
