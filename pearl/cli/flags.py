"""Command-line flags as pearl reads them: every number finite and within the bounds of
``pearl.core.limits``, every mistake one line on stderr and exit status 2.

``--duration-s nan`` once ran the simulator forever and ``--gpus 1e9`` built a state of a
billion GPUs; a flag's type here refuses them before the command starts.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

from pearl.core.limits import MAX_GPUS, MAX_SECONDS


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` with its errors on one line (no usage block): ``pearl simulate:
    error: argument --duration-s: 'nan' is not a finite number``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def number(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """A flag's type: a finite number in ``[low, high]`` (``(low, high]`` if ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < low or (low_open and value == low) or value > high:
            bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{text} is outside {bounds}")
        return value

    parse.__name__ = "number"
    return parse


def integer(low: int, high: int) -> Callable[[str], int]:
    """A flag's type: a whole number in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside [{low}, {high}]")
        return value

    parse.__name__ = "integer"
    return parse


seconds = number(0.0, MAX_SECONDS)
positive_seconds = number(0.0, MAX_SECONDS, low_open=True)
gpus = integer(1, MAX_GPUS)
port = integer(0, 65_535)
repeats = integer(1, 1_000_000)
