"""The generated reference of every config field (graphstep/config/reference.py): it lists every field, option
and Megatron-Core name with a default and a meaning, ``graphstep config --list`` prints it, and docs/config.md
is exactly what it generates."""

import dataclasses
from pathlib import Path

from graphstep.config import OptimizerConfig
from graphstep.config.megatron import NO_EFFECT, NOT_OFFERED, RENAMED, family_options, flat_names
from graphstep.config.reference import DOCS_PAGE, config_reference, documented_fields, main, reference_markdown

ROOT = Path(__file__).resolve().parents[1]


def _rows():
    return {entry.flat_name or entry.name: entry for table in config_reference() for entry in table.entries}


def test_every_field_option_and_megatron_name_has_a_row_with_a_meaning():
    rows = _rows()
    shared = {f.name for f in dataclasses.fields(OptimizerConfig)}
    names = shared | set(flat_names(OptimizerConfig)) | set(NO_EFFECT) | set(NOT_OFFERED) | set(RENAMED)
    assert set(rows) == names
    assert not [name for name, entry in rows.items() if not entry.meaning.strip()]


def test_every_option_is_documented_where_it_is_declared():
    for cls in (OptimizerConfig, *family_options(OptimizerConfig).values()):
        undocumented = [entry.name for entry in documented_fields(cls) if not entry.meaning]
        assert not undocumented, cls.__name__


def test_defaults_are_the_dataclasses_own():
    rows = _rows()
    assert rows["lr"].default == repr(OptimizerConfig().lr)
    assert rows["muon_momentum"].default == repr(OptimizerConfig().muon.momentum)
    assert rows["muon"].default == "MuonOptions()"
    assert rows["capture"].section == "capture (graphstep's own)"


def test_what_has_no_effect_says_so():
    rows = _rows()
    for name in NO_EFFECT:
        assert rows[name].meaning.endswith("accepted, no effect."), name
    for name in NOT_OFFERED:
        assert "True is refused" in rows[name].meaning, name


def test_the_command_prints_the_reference(capsys):
    assert main(["--list"]) == 0
    assert capsys.readouterr().out == reference_markdown()


def test_the_docs_page_is_in_sync():
    page = ROOT / DOCS_PAGE
    assert page.read_text() == reference_markdown(), (
        f"{DOCS_PAGE} is out of date with the config's fields: regenerate it with "
        f"`python -m graphstep.config.reference --list > {DOCS_PAGE}`")
