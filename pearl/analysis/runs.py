"""Finding run logs on disk and analysing each one in a single streaming pass.

The rule for a ``RUN_DIR`` argument (``docs/analysis.md``):

- a file is one run log, whatever its name;
- a directory holding ``events.jsonl`` (a coordinator run) or ``seed*.jsonl`` files (one
  policy of ``pearl simulate``) contributes those files; a ``pearl run`` directory's
  ``rollout.jsonl`` (the rollout manager's log) is read with its ``events.jsonl`` (the
  coordinator's, when the run had one) as one run, the records of both merged by time
  (they share the run's clock), or alone without one;
- otherwise its immediate sub-directories are searched the same way (a ``pearl simulate
  --out`` directory holds one sub-directory per policy).

Nothing else is read: in particular the coordinator's ``journal.jsonl`` (its write-ahead
journal of states, not a run log) is never taken for one. A missing path, or a directory
where the rule finds nothing, is an ``InputError`` naming the path (exit status 2).

``analyze_log`` reads a log once with ``pearl.runlog.jsonl.read_records`` (skipping and
counting malformed lines, unknown types, other schema versions and invalid records) and
feeds every record to the accumulators of ``pearl.analysis.metrics``,
``pearl.analysis.decisions``, ``pearl.analysis.timeline`` and ``pearl.analysis.turns``;
memory grows with the run's duration and control events, not with its trajectories
(a rollout manager's log: also two floats per logged turn, ``pearl.analysis.turns``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pearl.analysis.decisions import BorrowWindows, ElasticUse, PdTimeline
from pearl.analysis.metrics import Batches, Consumption, RunInfo, Throughput, Training
from pearl.analysis.timeline import GpuTimeline
from pearl.analysis.turns import RolloutTurns
from pearl.io.documents import InputError
from pearl.runlog.jsonl import ReadStats, read_records
from pearl.runlog.schema import Record

RUN_LOG_NAME = "events.jsonl"
ROLLOUT_LOG_NAME = "rollout.jsonl"
SEED_LOG_GLOB = "seed*.jsonl"


@dataclass(frozen=True)
class RunLog:
    path: Path
    name: str  # a short label: "POLICY/seedN" or the run directory's name
    also: tuple[Path, ...] = ()  # the same run's other logs, read with it (merged by time)


def _logs_in(directory: Path) -> list[Path]:
    found = [directory / RUN_LOG_NAME] if (directory / RUN_LOG_NAME).is_file() else []
    if not found and (directory / ROLLOUT_LOG_NAME).is_file():
        found = [directory / ROLLOUT_LOG_NAME]  # a pearl run without a coordinator
    return found + sorted(p for p in directory.glob(SEED_LOG_GLOB) if p.is_file())


def _companions(path: Path) -> tuple[Path, ...]:
    """A coordinator's run log's companion in a ``pearl run`` directory: the rollout's."""
    rollout = path.parent / ROLLOUT_LOG_NAME
    return (rollout,) if path.name == RUN_LOG_NAME and rollout.is_file() else ()


def _label(path: Path) -> str:
    if path.name in (RUN_LOG_NAME, ROLLOUT_LOG_NAME):
        return path.parent.name or "run"
    return f"{path.parent.name}/{path.stem}" if path.parent.name else path.stem


def find_run_logs(paths: Sequence[Path]) -> list[RunLog]:
    """The run logs the arguments name, by the rule of the module docstring."""
    found: list[Path] = []
    companions: dict[Path, tuple[Path, ...]] = {}
    for path in paths:
        if not path.exists():
            raise InputError(path, "", "no such file or directory")
        if path.is_file():
            found.append(path)
            continue  # a file named is read alone
        logs = _logs_in(path)
        if not logs:
            subdirs = sorted(p for p in path.iterdir() if p.is_dir())
            logs = [log for sub in subdirs for log in _logs_in(sub)]
        if not logs:
            raise InputError(
                path, "", f"no run log ({RUN_LOG_NAME} or {SEED_LOG_GLOB}) here or one level down"
            )
        found += logs
        companions.update({log: _companions(log) for log in logs})
    out: list[RunLog] = []
    names: set[str] = set()
    for p in dict.fromkeys(found):  # each file once, in order
        name, k = _label(p), 2
        while name in names:
            name, k = f"{_label(p)}#{k}", k + 1
        names.add(name)
        out.append(RunLog(p, name, companions.get(p, ())))
    return out


@dataclass
class RunAnalysis:
    """Everything one pass over a run log produced: the summary and the plot series."""

    log: RunLog
    stats: ReadStats
    info: RunInfo
    throughput: Throughput
    training: Training
    batches: Batches
    consumption: Consumption
    pd: PdTimeline
    borrow: BorrowWindows
    elastic: ElasticUse
    timeline: GpuTimeline
    max_return_delay_s: float | None = None
    turns: RolloutTurns = field(default_factory=RolloutTurns)  # a rollout manager's records

    @property
    def end_t(self) -> float:
        return self.info.end_t

    def read_summary(self) -> dict[str, Any]:
        s = self.stats
        skipped = s.malformed + s.unknown_type + s.other_version + s.invalid
        return {
            "lines": s.lines,
            "records": s.records,
            "skipped": skipped,
            "malformed": s.malformed,
            "unknown_type": s.unknown_type,
            "other_version": s.other_version,
            "invalid": s.invalid,
            "by_type": dict(sorted(s.by_type.items())),
        }

    def summary(self) -> dict[str, Any]:
        end_t = self.end_t
        gpu_hours = self.timeline.gpu_hours(end_t)
        borrowed_h = self.borrow.lent_gpu_hours(end_t)
        elastic = self.elastic.summary(end_t, self.timeline.elastic_used_gpu_hours(end_t))
        if elastic["granted"] or elastic["requests"] or gpu_hours["by_source"]["elastic"] is None:
            # held from Slurm's grant to the end, as Slurm bills them (GPU records follow
            # the grant at the next decision, so they would count less)
            gpu_hours["by_source"]["elastic"] = elastic["granted_gpu_hours"]
        gpu_hours["by_source"]["borrowed"] = borrowed_h
        notes = self.timeline.notes() + self.info.notes()
        if self.max_return_delay_s is None:
            notes.append("max_return_delay_s unknown: not logged; pass --max-return-delay-s")
        out: dict[str, Any] = {
            "name": self.log.name,
            "path": str(self.log.path),
            "run": self.info.summary(),
            "read": self.read_summary(),
            "throughput": self.throughput.summary(
                self.info.duration_s, self.consumption.taken_back
            ),
            "training": self.training.summary(self.info.duration_s),
            "batches": self.batches.summary(),
            "rollout": self.consumption.summary(),
            "gpu_hours": gpu_hours,
            "pd": self.pd.summary(self.info.duration_s),
            "borrow": self.borrow.summary(end_t, self.training.waits_s, self.max_return_delay_s),
            "elastic": elastic,
            "notes": notes,
        }
        rollout_turns = self.turns.summary()
        if rollout_turns is not None:  # only in a log with turn (or lost) records
            out["rollout_turns"] = rollout_turns
        return out


def _without_run_bounds(records: Iterator[Record]) -> Iterator[Record]:
    """A companion log's records less its ``run_started``/``run_ended``: the run's are the
    main log's (the coordinator's), one incarnation each, not two."""
    return (r for r in records if r.type not in ("run_started", "run_ended"))


def analyze_log(log: RunLog, max_return_delay_s: float | None = None) -> RunAnalysis:
    """One streaming pass over ``log``."""
    stats = ReadStats()
    run = RunAnalysis(
        log=log,
        stats=stats,
        info=RunInfo(),
        throughput=Throughput(),
        training=Training(),
        batches=Batches(),
        consumption=Consumption(),
        pd=PdTimeline(),
        borrow=BorrowWindows(),
        elastic=ElasticUse(),
        timeline=GpuTimeline(),
        max_return_delay_s=max_return_delay_s,
    )
    handlers: dict[str, list[Callable[[Any], None]]] = {}
    for acc in (
        run.info,
        run.throughput,
        run.training,
        run.batches,
        run.consumption,
        run.pd,
        run.borrow,
        run.elastic,
        run.timeline,
        run.turns,
    ):
        for kind, handler in acc.handlers().items():
            handlers.setdefault(kind, []).append(handler)
    info_add = run.info.see
    record: Record
    logs = [read_records(log.path, stats)]
    logs += [_without_run_bounds(read_records(p, stats)) for p in log.also]
    records = heapq.merge(*logs, key=lambda r: r.t) if log.also else logs[0]
    for record in records:
        info_add(record.t)
        for handler in handlers.get(record.type, ()):
            handler(record)
    if run.max_return_delay_s is None and run.info.started is not None:
        run.max_return_delay_s = run.info.started.max_return_delay_s  # the policy's, logged
    return run
