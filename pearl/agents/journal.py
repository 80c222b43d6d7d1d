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
from typing import IO, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pearl.core.limits import (
    MAX_GROUP_SIZE,
    MAX_ID_CHARS,
    MAX_TOKENS,
    MAX_TRAJECTORIES,
    NonNegInt,
    Seconds,
    Tokens,
)
from pearl.io.documents import one_line
from pearl.io.untrusted import MAX_DOCUMENT_BYTES, loads_json

EVENTS = ("start", "admit", "turn", "env", "finish", "batch", "updated", "lost")
TrajId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
Version = Annotated[int, Field(ge=-1, le=2**62)]  # -1: a token the model did not generate


class Event(BaseModel):
    """One journal line's fields, checked before it is replayed (the module's table);
    ``start``'s are checked against the configuration instead."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    e: str
    t: Seconds


class AdmitEvent(Event):
    group_id: NonNegInt
    traj_ids: tuple[TrajId, ...] = Field(min_length=1, max_length=MAX_GROUP_SIZE)


class TurnEvent(Event):
    traj_id: TrajId
    spans: tuple[tuple[Version, Tokens], ...] = Field(max_length=MAX_TOKENS)


class EnvEvent(Event):
    traj_id: TrajId
    env_s: Seconds
    observation_tokens: Tokens


class FinishEvent(Event):
    traj_id: TrajId
    trajectory: dict[str, Any]


class BatchEvent(Event):
    batch_id: NonNegInt
    traj_ids: tuple[TrajId, ...] = Field(max_length=MAX_TRAJECTORIES)


class UpdatedEvent(Event):
    version: NonNegInt


class LostEvent(Event):
    traj_id: TrajId


SCHEMAS: dict[str, type[Event]] = {
    "start": Event, "admit": AdmitEvent, "turn": TurnEvent, "env": EnvEvent, "finish": FinishEvent,
    "batch": BatchEvent, "updated": UpdatedEvent, "lost": LostEvent,
}  # fmt: skip


def event_of(doc: dict[str, Any]) -> Event:
    """``doc``'s event, its fields checked; a ``ValueError`` naming the first bad one."""
    try:
        return SCHEMAS[doc["e"]].model_validate(doc)
    except ValidationError as err:
        e = err.errors()[0]
        field = ".".join(str(p) for p in e["loc"]) or "(event)"
        raise ValueError(f"field '{field}': {e['msg']}") from None


class JournalError(ValueError):
    """A journal that cannot be replayed: one line naming the file, line and problem (a
    control character it quotes is escaped)."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


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
