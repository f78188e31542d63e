#!/usr/bin/env python
"""Benchmark the HBM/DRAM/NVMe data plane against raw copies and raw disk I/O.

Same as ``tiercache bench``; options: ``--help``. Example::

    python scripts/bench_tiers.py --json bench_tiers.json --save-profile measured.json
"""

import sys

from tiercache.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
