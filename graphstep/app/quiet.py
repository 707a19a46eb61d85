"""Keep torch's C++ trace logging out of the app's output.

torch.profiler's C++ side (kineto) writes ``USDT:... profiler_start`` / ``profiler_stop`` lines straight
to file descriptor 2 every time a profiler starts and stops (torch 2.13, CPU build). They are markers for
tracing tools, not messages for the user, and no log level hides them without hiding kineto's errors too
(``KINETO_LOG_LEVEL`` ranks them above ERROR, and it is read only once per process). So around the
profiler the app sends fd 2 to a temporary file and afterwards copies every other line back.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

KINETO_TRACE_PREFIX = b"USDT:"


@contextlib.contextmanager
def drop_stderr_lines(prefix: bytes = KINETO_TRACE_PREFIX):
    """Within the block, lines written to fd 2 that start with ``prefix`` are dropped; the others reach
    stderr when the block ends (in their order, after a delay, even if the block raises)."""
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (a daemon, some embedders): nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as sink:
        _flush_python_stderr()
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            _flush_python_stderr()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = b"".join(line for line in sink.read().splitlines(keepends=True) if not line.startswith(prefix))
            _write_all(2, kept)


def _flush_python_stderr() -> None:
    with contextlib.suppress(Exception):  # a replaced sys.stderr may be closed or lack flush
        sys.stderr.flush()


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]
