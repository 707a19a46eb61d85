"""``python -m graphstep``: the same as the ``graphstep`` console script."""

import sys

from .app.cli import main

sys.exit(main())
