"""Slurm's text, both ways: submission parameters out, ``sacct``/``squeue`` output in.

Pure functions: no subprocess, no clock. The allocation backend runs the commands and
hands their output here; tests feed recorded output (``../shared/traces``, golden files).

Parsing rules:
- ``sacct --parsable2`` (``|``) or tab-separated output with a header line; any columns,
  in any order. ``JobID`` is split into the job (``123``), an array task (``123_4``, or a
  pending range ``123_[4-9]``), a heterogeneous component (``123+1``) and a step
  (``.batch``, ``.extern``, ``.0``). ``State`` keeps its first word (``CANCELLED by 42``
  is ``CANCELLED``, by ``42``). ``Elapsed``/``Timelimit`` are ``[D-]HH:MM:SS``,
  ``MM:SS`` or ``UNLIMITED``; ``ExitCode`` is ``code:signal``; times are ISO 8601 or
  ``Unknown``/``None`` (absent).
- ``squeue`` output in ``SQUEUE_FORMAT`` (ours, so its columns are known).
- Host lists: ``node[01-03,07],gpu5`` expands to each host, zero padding kept.

Bad input raises ``SlurmTextError`` naming the line and the field; a reader that must
not stop on one odd line catches it and counts it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

SQUEUE_FIELDS = (
    "job_id", "state", "reason", "start", "nodes", "partition", "name", "end", "time_limit"
)  # fmt: skip
SQUEUE_FORMAT = "%i|%T|%r|%S|%N|%P|%j|%e|%l"  # squeue --noheader --format=...; one field each


class SlurmTextError(ValueError):
    pass


@dataclass(frozen=True)
class JobId:
    job: int
    array_task: str | None = None  # "4", or a pending range "[4-9]"
    het_component: int | None = None
    step: str | None = None  # "batch", "extern", "0", ...

    @property
    def is_step(self) -> bool:
        return self.step is not None


@dataclass(frozen=True)
class SacctRow:
    job_id: JobId
    state: str
    state_by: str | None  # "CANCELLED by 42": who
    exit_code: int | None
    exit_signal: int | None
    elapsed_s: float | None
    fields: dict[str, str]  # every column, raw


@dataclass(frozen=True)
class SqueueRow:
    job_id: JobId
    state: str
    reason: str | None  # pending reason; None when "None"
    start: datetime | None  # running: start; pending: Slurm's estimate, if any
    nodes: tuple[str, ...]
    partition: str
    name: str
    end: datetime | None  # time limit; once preempted, the end of the grace period
    time_limit_s: float | None  # None: UNLIMITED


_JOB_ID = re.compile(
    r"^(?P<job>\d+)"
    r"(?:_(?P<task>\d+|\[[^\]]+\]))?"
    r"(?:\+(?P<het>\d+))?"
    r"(?:\.(?P<step>[A-Za-z0-9_-]+))?$"
)


def parse_job_id(text: str) -> JobId:
    m = _JOB_ID.match(text.strip())
    if m is None:
        raise SlurmTextError(f"JobID: {text!r} is not a Slurm job id")
    het = m.group("het")
    return JobId(int(m.group("job")), m.group("task"), int(het) if het else None, m.group("step"))


def parse_duration_s(text: str) -> float | None:
    """``[D-]HH:MM:SS``, ``MM:SS``, ``MM:SS.mmm`` in seconds; None for ``UNLIMITED``/empty."""
    t = text.strip()
    if t in ("", "UNLIMITED", "Partition_Limit", "INVALID"):
        return None
    days = 0
    if "-" in t:
        d, t = t.split("-", 1)
        days = _int(d, "duration", text)
    parts = t.split(":")
    if not 1 <= len(parts) <= 3:
        raise SlurmTextError(f"duration: {text!r} is not [D-]HH:MM:SS")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise SlurmTextError(f"duration: {text!r} is not [D-]HH:MM:SS") from None
    seconds = 0.0
    for v in values:
        seconds = seconds * 60 + v
    return days * 86400 + seconds


def parse_time(text: str) -> datetime | None:
    t = text.strip()
    if t in ("", "Unknown", "None", "N/A"):
        return None
    try:
        return datetime.fromisoformat(t)
    except ValueError:
        raise SlurmTextError(f"time: {text!r} is not ISO 8601") from None


def expand_hostlist(text: str) -> tuple[str, ...]:
    """``node[01-03,07],gpu5`` -> node01, node02, node03, node07, gpu5."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]*)\[([^\]]*)\]|([^,]+)", text.strip()):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise SlurmTextError(f"nodelist: {text!r} has a bad range {part!r}")
            width = len(lo)
            hosts += [f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return tuple(hosts)


def parse_sacct(text: str) -> list[SacctRow]:
    """Rows of ``sacct --parsable2`` (or tab-separated) output with its header line."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    sep = "\t" if "\t" in lines[0] else "|"
    header = lines[0].split(sep)
    if "JobID" not in header or "State" not in header:
        raise SlurmTextError("line 1: header has no JobID or State column")
    rows = []
    for number, line in enumerate(lines[1:], start=2):
        values = line.split(sep)
        if len(values) != len(header):
            raise SlurmTextError(
                f"line {number}: {len(values)} fields, the header has {len(header)}"
            )
        fields = dict(zip(header, values, strict=True))
        try:
            rows.append(_sacct_row(fields))
        except SlurmTextError as err:
            raise SlurmTextError(f"line {number}: {err}") from None
    return rows


def _sacct_row(fields: dict[str, str]) -> SacctRow:
    state, _, by = fields["State"].partition(" by ")
    code = signal = None
    if fields.get("ExitCode"):
        c, _, s = fields["ExitCode"].partition(":")
        code, signal = _int(c, "ExitCode", fields["ExitCode"]), _int(s or "0", "ExitCode", s)
    return SacctRow(
        job_id=parse_job_id(fields["JobID"]),
        state=state.strip(),
        state_by=by.strip() or None,
        exit_code=code,
        exit_signal=signal,
        elapsed_s=parse_duration_s(fields.get("Elapsed", "")),
        fields=fields,
    )


def parse_squeue(text: str) -> list[SqueueRow]:
    """Rows of ``squeue --noheader --format=SQUEUE_FORMAT``."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        values = line.split("|")
        if len(values) != len(SQUEUE_FIELDS):
            raise SlurmTextError(
                f"line {number}: {len(values)} fields, squeue format has {len(SQUEUE_FIELDS)}"
            )
        f = dict(zip(SQUEUE_FIELDS, values, strict=True))
        try:
            nodes = expand_hostlist(f["nodes"]) if f["nodes"] not in ("", "(null)") else ()
            rows.append(
                SqueueRow(
                    job_id=parse_job_id(f["job_id"]),
                    state=f["state"].strip(),
                    reason=None if f["reason"] in ("None", "") else f["reason"],
                    start=parse_time(f["start"]),
                    nodes=nodes,
                    partition=f["partition"],
                    name=f["name"],
                    end=parse_time(f["end"]),
                    time_limit_s=parse_duration_s(f["time_limit"]),
                )
            )
        except SlurmTextError as err:
            raise SlurmTextError(f"line {number}: {err}") from None
    return rows


def _int(text: str, field: str, whole: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SlurmTextError(f"{field}: {whole!r} is not a number") from None


def parse_restarts(scontrol_show_job: str) -> int:
    """``Restarts=N`` of ``scontrol show job`` output (how often Slurm has requeued the
    job: a requeue counts at once, while the incarnation it ends still runs)."""
    found = re.search(r"\bRestarts=(\d+)\b", scontrol_show_job)
    if found is None:
        raise SlurmTextError("scontrol show job: no Restarts= field")
    return int(found.group(1))


def preempted(scontrol_show_job: str) -> bool:
    """Whether ``scontrol show job`` says the job is being preempted (``PreemptTime`` set:
    Slurm signals it at the start of its grace time and requeues it only after)."""
    found = re.search(r"\bPreemptTime=(\S+)", scontrol_show_job)
    return found is not None and found.group(1) not in ("None", "Unknown")
