"""How every ``pearl`` command ends on bad input: one line on stderr, exit status 2."""

from __future__ import annotations

import argparse
import sys

from pearl.io.documents import InputError


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command (``args.run``); an ``InputError`` is one line and exit 2."""
    try:
        code: int = args.run(args)
    except InputError as err:
        print(f"pearl: error: {err}", file=sys.stderr)
        return 2
    return code
