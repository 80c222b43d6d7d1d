"""The coordinator's write-ahead journal: append-only JSONL, fsync'd, replayed on restart.

The coordinator writes a record *before* it acts on it and another when the action is
done, so a coordinator killed at any point can tell, on restart, what it had decided,
what it had started and what it had finished:

- ``state``: the full ``ClusterState`` after a decision (what the next decision starts
  from);
- ``intent``: an action about to be taken (``submit``, ``release``, ``plan``), with an id;
- ``done``: the action with that id finished (``ok`` and an ``error`` if it failed).

``replay`` reads the journal back: the last state, the intents with no ``done``, and
every submission (the coordinator finds those allocations again in Slurm). Each line is
flushed and fsync'd before the action it announces, so a crash loses at most the line
being written: a last line without its newline is dropped (and cut off when the journal
is opened again, ``valid_bytes``); a malformed line anywhere else is corruption and
raises an ``InputError`` naming the file and line.

Compaction (``Journal.compact``, when the file has grown past a size): the journal is
rewritten as the last state plus the submissions that state does not hold yet, into a
temporary file that is fsync'd and renamed over the journal, so a crash leaves either the
old journal or the new one, never a mix. Replaying the compacted journal gives the same
state and the same submissions to look for.

Invariants: ``seq`` increases by one per record (from 0, or from the first record of a
compacted journal, which keeps counting); replaying a journal and appending to it
continues the sequence; the state a replay returns is the last one written, validated
(``ClusterState``).
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal

from pearl.core.state import ClusterState
from pearl.io.documents import InputError, parse
from pearl.io.untrusted import MAX_DOCUMENT_BYTES, loads_json

JOURNAL_VERSION = 1
Kind = Literal["state", "intent", "done"]
_KINDS = ("state", "intent", "done")


@dataclass
class Replay:
    state: ClusterState | None = None
    open_intents: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> intent
    submitted: dict[str, dict[str, Any]] = field(default_factory=dict)  # every submit intent
    next_seq: int = 0
    num_records: int = 0
    truncated_tail: bool = False  # the last line was cut short (a crash while writing)
    valid_bytes: int = 0  # length of the journal up to its last complete record


def replay(path: Path) -> Replay:
    """Read the journal at ``path`` (a missing file is an empty journal)."""
    out = Replay()
    if not path.exists():
        return out
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines[-1]:  # no newline at the end: the last write was cut short, drop it
        out.truncated_tail = True
    for number, line in enumerate(lines[:-1], start=1):
        try:
            record = loads_json(line, max_bytes=MAX_DOCUMENT_BYTES)
            if number == 1 and isinstance(record, dict) and isinstance(record.get("seq"), int):
                out.next_seq = record["seq"]  # a compacted journal keeps counting
            _check(record, out.next_seq)
        except ValueError as err:  # UntrustedInput among them
            raise InputError(path, f"line {number}", f"corrupt journal record: {err}") from None
        _apply(out, record, path, number)
        out.valid_bytes += len(line) + 1
    return out


def _check(record: Any, expected_seq: int) -> None:
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    if record.get("v") != JOURNAL_VERSION:
        raise ValueError(f"v: {record.get('v')!r} is not {JOURNAL_VERSION}")
    if record.get("seq") != expected_seq:
        raise ValueError(f"seq: {record.get('seq')!r}, expected {expected_seq}")
    if record.get("kind") not in _KINDS:
        raise ValueError(f"kind: {record.get('kind')!r} is not one of {_KINDS}")
    if not isinstance(record.get("data"), dict):
        raise ValueError("data: not an object")


def _apply(out: Replay, record: dict[str, Any], path: Path, number: int) -> None:
    data = record.get("data")
    kind = record["kind"]
    if not isinstance(data, dict):
        raise InputError(path, f"line {number}.data", "missing, or not a JSON object")
    if kind == "state":
        out.state = parse(ClusterState, data, path, f"line {number}.data")
    elif kind == "intent":
        out.open_intents[str(data.get("id"))] = data
        if data.get("action") == "submit":
            out.submitted[str(data.get("id"))] = data
    else:
        out.open_intents.pop(str(data.get("id")), None)
    out.next_seq += 1
    out.num_records += 1


class Journal:
    """Appends records; open it after ``replay`` so the sequence continues."""

    def __init__(
        self,
        path: Path,
        next_seq: int = 0,
        valid_bytes: int | None = None,
        submitted: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """``valid_bytes`` (from ``replay``): cut a record left half-written by a crash
        before appending, so it does not end up in the middle of the journal.
        ``submitted`` (from ``replay``): the submissions journalled so far; the journal
        adds those it writes, and compaction keeps them."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.seq = path, next_seq
        self.submitted: dict[str, dict[str, Any]] = dict(submitted or {})
        self._lock = path.with_name(path.name + ".lock").open("a")
        try:  # one writer per journal: a second coordinator on the run stops here
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise InputError(path, "", "another coordinator is writing this journal") from None
        if valid_bytes is not None and path.exists() and path.stat().st_size > valid_bytes:
            with path.open("r+b") as f:
                f.truncate(valid_bytes)
                os.fsync(f.fileno())
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def append(self, kind: Kind, data: dict[str, Any], t: float) -> int:
        """Write one record and make it durable; its sequence number."""
        record = {"v": JOURNAL_VERSION, "seq": self.seq, "t": t, "kind": kind, "data": data}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.seq += 1
        return self.seq - 1

    def state(self, state: ClusterState, t: float) -> int:
        return self.append("state", state.model_dump(mode="json"), t)

    def intent(self, intent_id: str, action: str, t: float, **details: Any) -> int:
        data = {"id": intent_id, "action": action, **details}
        if action == "submit":
            self.submitted[intent_id] = data
        return self.append("intent", data, t)

    def done(self, intent_id: str, t: float, ok: bool = True, error: str = "") -> int:
        return self.append("done", {"id": intent_id, "ok": ok, "error": error}, t)

    def size_bytes(self) -> int:
        return self._file.tell()

    def compact(self, state: ClusterState, t: float) -> None:
        """Rewrite the journal as ``state`` plus the submissions it does not hold yet."""
        held = {a.allocation_id for a in state.allocations}
        records: list[tuple[Kind, dict[str, Any]]] = [("state", state.model_dump(mode="json"))]
        records += [("intent", i) for aid, i in self.submitted.items() if aid not in held]
        tmp = self.path.with_name(self.path.name + ".compact")
        with tmp.open("w", encoding="utf-8") as f:
            for n, (kind, data) in enumerate(records):
                rec = {
                    "v": JOURNAL_VERSION,
                    "seq": self.seq + n,
                    "t": t,
                    "kind": kind,
                    "data": data,
                }
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._file.close()
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself is durable
        finally:
            os.close(dir_fd)
        self.seq += len(records)
        self._file = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if not self._lock.closed:
            self._lock.close()  # releases the lock

    def __enter__(self) -> Journal:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
