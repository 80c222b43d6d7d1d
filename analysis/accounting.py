#!/usr/bin/env python3
"""Slurm accounting of pearl's jobs from ``sacct --parsable2`` output (a file, or - for stdin).

    python analysis/accounting.py SACCT_FILE [--json]

The library is ``pearl.analysis.accounting`` (``docs/analysis.md``).
"""

import sys

from pearl.analysis.accounting import main

if __name__ == "__main__":
    sys.exit(main())
