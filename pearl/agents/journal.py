"""The rollout manager's journal: what changed its books, one JSON event per line, so a
restarted manager rebuilds them exactly (``RolloutManager.open``).

Events (``{"e": kind, "t": run clock, ...}``), in the order they happened:

| event | fields | the ledger move it replays |
|---|---|---|
| ``start`` | ``run_started_unix_s``, ``rules``, ``seed`` | (the run; checked on resume) |
| ``admit`` | ``group_id``, ``traj_ids`` | ``admit`` |
| ``turn`` | ``traj_id``, ``spans`` (``[version, tokens]``) | ``sent``, ``generated``, |
|  |  | ``turn_ended`` |
| ``env`` | ``traj_id``, ``env_s``, ``observation_tokens`` | (turn statistics only) |
| ``finish`` | ``traj_id``, ``trajectory`` (its whole record) | ``finish`` |
| ``batch`` | ``batch_id``, ``traj_ids`` | ``take_batch`` (checked: the same ids) |
| ``updated`` | ``version`` | ``updated`` |
| ``lost`` | ``traj_id``, ``wasted_tokens`` | ``lost`` |

Each line is flushed when written, so a killed manager loses at most the line it was
writing (a last line without its newline is torn: not an event, cut when the manager
resumes); a malformed whole line is a corrupt journal, refused with its file and line
number. Not fsynced per line: a crash
of the node (not of the process) may lose the last events, which replays as those
trajectories' turns never having happened (they run again).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pearl.io.untrusted import MAX_DOCUMENT_BYTES, loads_json

EVENTS = ("start", "admit", "turn", "env", "finish", "batch", "updated", "lost")


class JournalError(ValueError):
    """A journal that cannot be replayed: one line naming the file, line and problem."""


class RolloutJournal:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def write(self, event: str, t: float, **fields: Any) -> None:
        assert event in EVENTS, event
        line = json.dumps({"e": event, "t": round(t, 6), **fields}, separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_journal(path: Path, repair: bool = False) -> Iterator[dict[str, Any]]:
    """The journal's events in order. A torn last line (no newline after it: the write a
    killed manager did not finish) is not an event; with ``repair`` (the manager that
    resumes, the only writer) the file is cut back to the events before it, so the next
    event starts a line of its own. Without, the file is never written (a reader beside a
    live manager may see its last line half written)."""
    if not path.exists():
        return
    lines = path.read_bytes().split(b"\n")
    good_bytes = 0
    for number, raw in enumerate(lines, start=1):
        if number == len(lines):  # after the last newline: empty, or a torn line
            if raw and repair:
                with path.open("r+b") as f:
                    f.truncate(good_bytes)
            return
        try:
            event = loads_json(raw, max_bytes=MAX_DOCUMENT_BYTES)
            if not isinstance(event, dict) or event.get("e") not in EVENTS:
                raise ValueError(f"not a journal event: {raw[:80]!r}")
        except ValueError as err:
            raise JournalError(f"{path}:{number}: {err}") from None
        good_bytes += len(raw) + 1
        yield event
