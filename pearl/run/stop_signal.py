"""The signal that stopped this process's run, if one did: the run's signal handler
(``pearl.run.local.run``) notes it, and the parts that end differently for a cancel than
for a requeue (``pearl.run.coordinated``: the elastic jobs) read it. Signals are the
process's, so this is too."""

from __future__ import annotations

import signal

_received: list[signal.Signals] = []


def note(sig: signal.Signals) -> None:
    _received.append(sig)


def first() -> signal.Signals | None:
    return _received[0] if _received else None


def clear() -> None:
    _received.clear()
