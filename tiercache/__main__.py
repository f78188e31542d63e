"""``python -m tiercache``: the ``tiercache`` command (``tiercache.cli.main``), exiting with its status.

The one module outside ``tiercache/cli/`` that imports the CLI (README "Import rule").
"""

from __future__ import annotations

import sys

from tiercache.cli import main

if __name__ == "__main__":
    sys.exit(main())
