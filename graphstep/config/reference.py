"""The reference of every ``OptimizerConfig`` field, its default and meaning, generated from the code: the meaning
is the field's docstring, the section its ``# ---- title ----`` comment, so the reference cannot drift from the
dataclasses. ``graphstep config --list`` prints it; docs/config.md holds it, and tests/test_config_reference.py
checks that the page is what this module generates.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
import textwrap
from typing import Optional, Sequence

from . import OptimizerConfig
from .megatron import NO_EFFECT, NOT_OFFERED, RENAMED, family_options

DOCS_PAGE = "docs/config.md"
_SECTION = re.compile(r"^\s*# -+ (.+?) -+\s*$")

_INTRO = """\
Every field of `graphstep.OptimizerConfig`, its default and what it does. Generated from the code by
`graphstep config --list` (graphstep/config/reference.py); a test keeps this page in sync.

Each optimizer family's own options are a frozen dataclass in its module, held by the field named after the
family: `OptimizerConfig(optimizer="muon", muon=MuonOptions(momentum=0.9))` (the classes are importable from
`graphstep.config`). Megatron-Core's flat names are accepted too, in the constructor and in `replace`:
`OptimizerConfig(muon_momentum=0.9)` sets that one option. Each option's flat name is listed beside it; code
reads the option, `config.muon.momentum`. A misspelled name is refused with the closest ones."""


@dataclasses.dataclass(frozen=True)
class FieldEntry:
    """One row of the reference."""

    name: str
    default: str
    meaning: str
    section: str = ""
    flat_name: str = ""


def documented_fields(cls) -> list[FieldEntry]:
    """Every field of dataclass ``cls`` in declaration order, with its default, its docstring (the string right
    after it in the class body) and its section (the last ``# ---- title ----`` comment above it)."""
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    body = ast.parse(source).body[0].body
    docs = {a.target.id: inspect.cleandoc(b.value.value) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)}
    starts = {node.target.id: node.lineno for node in body if isinstance(node, ast.AnnAssign)}
    source_lines = source.splitlines()
    entries = []
    for field in dataclasses.fields(cls):
        above = source_lines[:starts[field.name] - 1]
        titles = [match.group(1) for match in map(_SECTION.match, above) if match]
        entries.append(FieldEntry(field.name, _default(field), docs.get(field.name, ""),
                                  titles[-1] if titles else ""))
    return entries


def _default(field: dataclasses.Field) -> str:
    default = field.default
    if dataclasses.is_dataclass(default):  # a family's options: their defaults are listed in their own table
        return f"{type(default).__name__}()"
    return repr(default)


@dataclasses.dataclass(frozen=True)
class Table:
    """One table of the reference: a heading (``level`` 2 or 3), a paragraph above it, its rows."""

    title: str
    entries: list[FieldEntry]
    level: int = 2
    intro: str = ""


def config_reference(cls=OptimizerConfig) -> list[Table]:
    """The reference as tables: the config's shared fields by section, each family's options (with
    Megatron-Core's flat name of each) after the section holding them, then Megatron-Core's names held
    nowhere."""
    options = family_options(cls)
    sections: dict[str, list[FieldEntry]] = {}
    for entry in documented_fields(cls):
        sections.setdefault(entry.section, []).append(entry)
    tables = []
    for section, entries in sections.items():
        tables.append(Table(_heading(section), entries))
        for entry in entries:
            if entry.name in options:
                tables.append(Table(
                    f"`{entry.name}`: `{options[entry.name].__name__}` "
                    f"({options[entry.name].__module__.replace('.', '/')}.py)",
                    [dataclasses.replace(option, flat_name=f"{entry.name}_{option.name}")
                     for option in documented_fields(options[entry.name])],
                    level=3, intro=inspect.getdoc(options[entry.name]) or ""))
    tables.append(Table("Megatron-Core's fields accepted without effect", [
        FieldEntry(name, repr(field.default), f"{field.meaning}: accepted, no effect.")
        for name, field in NO_EFFECT.items()]))
    tables.append(Table("Megatron-Core's switches for features graphstep does not offer", [
        FieldEntry(name, "False", f"Only False (the default) is accepted; True is refused: {why}.")
        for name, why in NOT_OFFERED.items()]))
    tables.append(Table("Other spellings", [
        FieldEntry(old, "None", f"Megatron-Core 0.16.1's name of `{new}`: a bool sets it; None leaves it.")
        for old, new in RENAMED.items()]))
    return tables


def _heading(section: str) -> str:
    """A section comment as a heading: "precision" -> "Precision" ("fp8 ..." stays as written)."""
    first = section.split(" ", 1)[0]
    return section[:1].upper() + section[1:] if first.isalpha() else section


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def reference_markdown(cls=OptimizerConfig) -> str:
    """The reference as a Markdown page (what docs/config.md holds)."""
    out = [f"# {cls.__name__} reference", "", _INTRO]
    for table in config_reference(cls):
        out += ["", f"{'#' * table.level} {table.title}", ""]
        if table.intro:
            out += [_cell(table.intro), ""]
        flat = any(entry.flat_name for entry in table.entries)
        out.append("| Field | Megatron-Core's name | Default | Meaning |" if flat else "| Field | Default | Meaning |")
        out.append("|---|---|---|---|" if flat else "|---|---|---|")
        for entry in table.entries:
            cells = [f"`{entry.name}`", *([f"`{entry.flat_name}`"] if flat else []), f"`{_cell(entry.default)}`",
                     _cell(entry.meaning)]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``graphstep config --list``: print the reference of every field."""
    parser = argparse.ArgumentParser(prog="graphstep config", description="OptimizerConfig's fields.")
    parser.add_argument("--list", action="store_true", help="print every field, its default and meaning "
                        "(Markdown, the text of docs/config.md)")
    args = parser.parse_args(argv)
    if not args.list:
        parser.print_help()
        return 2
    sys.stdout.write(reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
