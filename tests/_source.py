"""Where a marker stands in a test's own source: the line numbers capture's findings must name."""


def line_of(path: str, marker: str) -> int:
    """The first line of ``path`` holding ``marker`` (lines that call ``_line_of`` themselves excluded)."""
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)
