"""The optimizer step, side by side in one process: ``graphstep bench`` from a checkout.

The benchmark itself lives in graphstep/app/bench.py (with its core in bench_core.py, shared with
perf/harness.py); this script only puts the checkout first on the path and calls it.

    python perf/bench_step.py [--quick] [--interleave] [--only ...] [--json out.json]   # --help for all flags
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's graphstep, not an installed one
from graphstep.app.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
