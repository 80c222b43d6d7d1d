"""Running one surface on one fuzzed input, and the property every fuzz test asserts.

``run_pearl(argv)`` runs the ``pearl`` command in this process (thousands of cases would
not afford a process each), with its output captured and a wall-clock bound: a case past
``HANG_S`` fails as a hang. ``assert_one_line_error`` is the property: exit 0, or exit 2
with exactly one line on stderr that names the file.
"""

from __future__ import annotations

import contextlib
import io
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pearl.cli.main import main
from pearl.io.documents import InputError

HANG_S = 30  # no single case may take longer (the slowest valid one: ~2 s)
T = TypeVar("T")


class Hang(AssertionError):
    pass


@contextlib.contextmanager
def bounded(what: str, seconds: int = HANG_S) -> Iterator[None]:
    """Fail with ``Hang`` if the block takes longer than ``seconds``."""

    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"{what}: still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


def run_pearl(argv: list[str]) -> Outcome:
    out, err = io.StringIO(), io.StringIO()
    captured = contextlib.redirect_stdout(out), contextlib.redirect_stderr(err)
    with bounded(f"pearl {' '.join(argv)}"), captured[0], captured[1]:
        try:
            code = main(argv)
        except SystemExit as e:  # argparse
            code = int(e.code or 0)
    return Outcome(code, out.getvalue(), err.getvalue())


def assert_one_line_error(outcome: Outcome, names: str | Path) -> None:
    """Exit 0, or 2 with one line naming ``names`` (a file); never anything else."""
    assert outcome.code in (0, 2), (outcome.code, outcome.err[-2000:])
    if outcome.code == 2:
        lines = [line for line in outcome.err.splitlines() if "ignored" not in line]
        assert len(lines) == 1, outcome.err[-2000:]
        assert str(names) in lines[0], lines[0]


def load_or_input_error(load: Callable[[], T], names: str | Path) -> T | None:
    """``load()``'s result, or None when it raised an ``InputError`` of one line naming
    ``names``; any other exception fails the case."""
    with bounded(f"loading {names}"):
        try:
            return load()
        except InputError as err:
            assert "\n" not in str(err), str(err)
            assert str(err).startswith(str(names)), str(err)
            return None
