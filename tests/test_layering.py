"""capture/ imports nothing from graphstep (docs/design.md §2, law 6): it captures any callable over static
tensors, and graphstep depends on it, never the reverse. Read from the sources, so a lazy import inside a
function counts too."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set:
    """Every module ``path`` imports, relative imports resolved (``from . import x`` names ``package.x``)."""
    package = list(path.relative_to(ROOT).with_suffix("").parts)
    package = package[:-1] if package[-1] != "__init__" else package[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}
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
