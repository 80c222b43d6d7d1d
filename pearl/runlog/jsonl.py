"""Writing and reading run logs (JSONL, schema in ``pearl.runlog.schema``).

The writer appends one line per record and flushes it, so a killed run loses at most
the line being written; ``close`` also fsyncs. The reader streams: it never holds the
file in memory, and it skips what it cannot use (a truncated last line, a malformed
line, an unknown type, another schema version), counting each kind in ``ReadStats``
instead of failing.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from pearl.io.untrusted import MAX_DOCUMENT_BYTES, UntrustedInput, loads_json
from pearl.runlog.schema import RECORD_TYPES, SCHEMA_VERSION, Record, decode, encode


class RunLogWriter:
    def __init__(self, path: Path, truncate: bool = False) -> None:
        """Append to ``path`` (a restarted coordinator continues its log), or start it
        afresh with ``truncate`` (a simulated run is written whole)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("w" if truncate else "a", encoding="utf-8")

    def write(self, record: Record) -> None:
        self._file.write(json.dumps(encode(record), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def __enter__(self) -> RunLogWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass
class ReadStats:
    lines: int = 0
    records: int = 0
    malformed: int = 0  # not JSON (a truncated last line included)
    unknown_type: int = 0
    other_version: int = 0
    invalid: int = 0  # a known type with a missing or wrong field
    by_type: Counter[str] = field(default_factory=Counter)


def read_records(path: Path, stats: ReadStats | None = None) -> Iterator[Record]:
    """The usable records of a run log, in file order; ``stats`` counts what was skipped."""
    stats = stats if stats is not None else ReadStats()
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            stats.lines += 1
            try:
                data = loads_json(line, max_bytes=MAX_DOCUMENT_BYTES)
            except UntrustedInput:  # malformed, nested too deep, not finite, ...
                stats.malformed += 1
                continue
            if not isinstance(data, dict):
                stats.malformed += 1
            elif data.get("v") != SCHEMA_VERSION:
                stats.other_version += 1
            elif data.get("type") not in RECORD_TYPES:
                stats.unknown_type += 1
            else:
                try:
                    record = decode(data)
                except ValueError:
                    stats.invalid += 1
                    continue
                stats.records += 1
                stats.by_type[record.type] += 1
                yield record
