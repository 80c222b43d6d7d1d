#!/usr/bin/env python3
"""Report on pearl runs from their job logs: plots, report.md, report.html, summary.json.

    python analysis/report.py RUN_DIR [RUN_DIR ...] [--out DIR] [--json] [--sacct FILE]

The same as ``pearl analyze``; the library is ``pearl.analysis`` (``docs/analysis.md``).
"""

import sys

from pearl.analysis.report import main

if __name__ == "__main__":
    sys.exit(main())
