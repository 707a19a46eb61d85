"""A keyword that names no field of a config dataclass, refused as Python refuses it (TypeError) but with the
closest field names: "OptimizerConfig has no field 'lrr': did you mean 'lr'?"."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Sequence

# difflib's ratio below which a field is not offered: 'lrr' -> 'lr' is 0.8, 'adam_beta' -> 'adam_beta1' 0.95,
# 'zzz' -> anything 0.
_CUTOFF = 0.6


def refusing_unknown_fields(cls, fields_doc: str, also: Sequence[str] = ()) -> object:
    """``cls.__init__`` (a dataclass's generated one), refusing a keyword that is no field of ``cls`` before it
    runs, with the closest of its fields and of ``also`` (names an outer wrapper accepts: Megatron-Core's flat
    ones); ``fields_doc`` says where the fields are described. ``dataclasses.replace`` builds the copy through
    ``__init__``, so a misspelled change is caught too."""
    init = cls.__init__
    fields = tuple(field.name for field in dataclasses.fields(cls))
    names = fields + tuple(also)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        unknown = [name for name in kwargs if name not in fields]
        if unknown:
            raise TypeError(unknown_fields_message(cls.__name__, unknown, names, fields_doc))
        init(self, *args, **kwargs)
    return __init__


def unknown_fields_message(owner: str, unknown: Sequence[str], names: Sequence[str], fields_doc: str) -> str:
    """What to say about the keywords ``unknown`` that are none of ``names``: each with its closest ones."""
    hints = {name: _suggestion(name, names) for name in unknown}
    where = f"every field, with what it does: {fields_doc}"
    if len(unknown) == 1:
        ((name, hint),) = hints.items()
        return f"{owner} has no field {name!r}: {hint}" if hint else f"{owner} has no field {name!r} ({where})"
    named = ", ".join(f"{name!r} ({hint})" if hint else repr(name) for name, hint in hints.items())
    return f"{owner} has no fields {named}; {where}"


def _suggestion(name: str, names: Sequence[str]) -> str:
    """'did you mean ...?' with the fields closest to ``name`` (ties in declaration order, up to 3), or ''."""
    scores = [(difflib.SequenceMatcher(None, name.lower(), field).ratio(), field) for field in names]
    best = max((score for score, _ in scores), default=0.0)
    close = [field for score, field in scores if score == best and score >= _CUTOFF][:3]
    return f"did you mean {' or '.join(map(repr, close))}?" if close else ""
