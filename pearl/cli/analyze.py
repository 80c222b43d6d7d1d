"""``pearl analyze RUN_DIR [RUN_DIR ...]``: the post-hoc report of run logs (``pearl.analysis``).

Plots, ``report.md``, ``report.html`` and ``summary.json`` go to ``--out`` (default
``FIRST/analysis``); ``--json`` prints only the summary. A missing path, or one holding no
run log, exits with status 2 and one line (``docs/analysis.md`` has the RUN_DIR rule).
"""

from __future__ import annotations

import argparse

from pearl.analysis import report


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("analyze", help="report on run logs: plots, report.md/html, summary")
    report.add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return report.run(args)
