"""The rollout manager: runs the rollout ledger (``pearl.rollout``) over real episodes.

It admits GRPO groups as the ledger's capacity allows (the staleness bound, ``max_in_flight``),
runs each trajectory as an agent-loop episode (``pearl.agents.loop.run_episode``) through
the router, tells the ledger every move, hands complete batches to the trainer
(``next_batch``; across processes, the spool of ``batches.py``), and applies the trainer's
updates (``updated``: the past-bound rule — interrupted trajectories go on under the new
weights, restarted ones are aborted and started again from their prompt, dropped ones
aborted). It never re-implements the books: what to admit, which groups make a batch and
what an update does are the ledger's answers.

What it writes, in the run directory:
- ``workload.json``: the ``WorkloadSnapshot`` the coordinator's predictor reads, every
  ``snapshot_interval_s`` (``pearl.rollout.observed``, the simulator's own rules);
- ``rollout.jsonl``: run-log records (``docs/log-schema.md``): ``turn_ended`` per turn,
  ``trajectory_finished`` / ``trajectory_lost`` per trajectory, ``batch_consumed``,
  ``past_bound``;
- ``rollout/journal.jsonl``: every move of the books (``journal.py``), and
  ``rollout/batches/``: every batch handed over (``batches.py``).

Restart (``RolloutManager.open`` on a run directory with a journal): the journal replays
into the same ledger; finished trajectories not yet in a batch come back whole; the ones
running when the manager died are lost (their environments' state is gone): each is
logged ``trajectory_lost`` with its wasted tokens and started again from its prompt, so
nothing is lost silently and its group still completes.

Group ``g``'s members share one task (environment seed ``seed * 1_000_003 + g``); member
``k`` samples with seed ``sampling.seed + index`` when ``sampling.seed`` is set (index: its
admission order), else at random.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic_core import PydanticSerializationError

from pearl.agents.batches import (
    RolloutBatch,
    Spool,
    trajectory_doc,
    trajectory_of,
    trajectory_problem,
)
from pearl.agents.journal import (
    AdmitEvent,
    BatchEvent,
    EnvEvent,
    FinishEvent,
    JournalError,
    LostEvent,
    RolloutJournal,
    TurnEvent,
    UpdatedEvent,
    event_of,
    read_journal,
)
from pearl.agents.loop import Limits, Trajectory, TurnRecord, run_episode
from pearl.core.workload import TrajPhase, WorkloadSnapshot
from pearl.engines.reference.tokenizer import Tokenizer
from pearl.envs.protocol import Environment
from pearl.io.atomic import write_text_atomic
from pearl.rollout.ledger import RUNNING, PastBoundOutcome, RolloutLedger
from pearl.rollout.observed import TurnObserver, mean_tool_left, progress, snapshot
from pearl.rollout.rules import Batching, RolloutRules
from pearl.router.router import Router, Sampling, TurnOutput
from pearl.runlog.jsonl import RunLogWriter
from pearl.runlog.records import batch_consumed_record, past_bound_record
from pearl.runlog.schema import (
    BatchCompleted,
    RunStarted,
    TrajectoryFinished,
    TrajectoryLost,
    TurnEnded,
)

log = logging.getLogger(__name__)

JOURNAL = "rollout/journal.jsonl"
SPOOL = "rollout/batches"
RUN_LOG = "rollout.jsonl"
WORKLOAD = "workload.json"


@dataclass(frozen=True)
class RolloutConfig:
    rules: RolloutRules
    sampling: Sampling
    limits: Limits = field(default_factory=Limits)
    seed: int = 0
    snapshot_interval_s: float = 1.0
    env_latency_s: float = 1.0  # a tool call's expected time, until the run has observed some
    scrape_interval_s: float | None = 1.0  # the engines' /metrics into the router (None: not)


def identity(config: RolloutConfig) -> dict[str, Any]:
    """What a resumed run must share with the run its journal holds: the rules, the
    sampling, the limits and the seed (the tasks of the groups), as JSON values."""
    fields = {
        "rules": dataclasses.asdict(config.rules),
        "sampling": dataclasses.asdict(config.sampling),
        "limits": dataclasses.asdict(config.limits),
        "seed": config.seed,
    }
    return dict(json.loads(json.dumps(fields)))


@dataclass
class _Live:
    """A running trajectory, as the predictor sees it."""

    traj_id: str
    index: int
    group_id: int
    phase: TrajPhase = TrajPhase.QUEUED
    context_tokens: int = 0
    turns_done: int = 0
    env_started_s: float = 0.0  # run clock
    task: asyncio.Task[None] | None = None
    # set when an update restarts or drops it: its episode's task is cancelled, and one
    # that goes on anyway (Python 3.11's wait_for can swallow a cancellation that meets a
    # result) is stopped at its next hook and never finishes the trajectory
    cancelled: bool = False


@dataclass
class RolloutManager:
    router: Router
    make_env: Callable[[], Environment]
    tok: Tokenizer
    config: RolloutConfig
    run_dir: Path
    ledger: RolloutLedger = field(init=False)
    observer: TurnObserver = field(default_factory=TurnObserver)
    live: dict[str, _Live] = field(default_factory=dict)
    finished: dict[str, Trajectory] = field(default_factory=dict)  # not in a batch yet
    _t0_unix_s: float = 0.0
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ledger = RolloutLedger(self.config.rules)
        self.spool = Spool(self.run_dir / SPOOL)
        self._journal: RolloutJournal | None = None
        self._log: RunLogWriter | None = None
        self._turns_done: dict[str, int] = {}  # replayed: turns of the running ones
        self.generated_tokens = 0  # by this incarnation's model turns (wasted ones included)
        self._completed_logged = -1  # the last batch logged batch_completed
        self._batch_started_t = 0.0  # when the previous batch was taken
        self._batch_predicted_s: float | None = None  # the batch being gathered, as first predicted
        self._batch_completed_t: float | None = None  # its last batch_completed
        self._batch_predicted_tag = 1.0
        # told of each batch as it is taken: (predicted s or None, measured s, the
        # prediction's tag), the measured time to its last batch_completed (one that lost a
        # group completes again)
        self.on_batch_completed: Callable[[float | None, float, float], None] | None = None
        # the books changed: admission may go on / a batch may be complete
        self._admit_wake = asyncio.Event()
        self._batch_wake = asyncio.Event()

    def _poke(self) -> None:
        self._admit_wake.set()
        self._batch_wake.set()

    # --- life ----------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        router: Router,
        make_env: Callable[[], Environment],
        tok: Tokenizer,
        config: RolloutConfig,
        run_dir: Path,
    ) -> RolloutManager:
        """A manager on ``run_dir``: a new run, or the one its journal holds, resumed."""
        m = cls(router, make_env, tok, config, run_dir)
        events = list(read_journal(run_dir / JOURNAL, repair=True))
        m._journal = RolloutJournal(run_dir / JOURNAL)
        m._log = RunLogWriter(run_dir / RUN_LOG)
        if events:
            m._replay(events)
        else:
            m._t0_unix_s = time.time()
            m._journal.write("start", 0.0, run_started_unix_s=m._t0_unix_s, **identity(config))
            m._log.write(
                RunStarted(
                    t=0.0, run_id=run_dir.name, source="rollout", policy="", seed=config.seed
                )
            )
        for traj_id in [r.traj_id for r in m.ledger.unconsumed() if r.state in RUNNING]:
            m._lose(traj_id)  # running when the manager died: started again
        m._batch_completed(m.now_s())
        return m

    def start(self) -> None:
        """Admission, the snapshot writer and the spool's requests, as background tasks.
        A first batch begins here (its time leaves out the engines' start before it)."""
        if self.ledger.totals.batches == 0 and self._batch_predicted_s is None:
            self._batch_started_t = self.now_s()
        for work in (self._admit_forever(), self._snapshot_forever(), self._spool_forever()):
            task = asyncio.create_task(work)
            task.add_done_callback(_report_death)
            self._tasks.append(task)
        if self.config.scrape_interval_s is not None:
            scrape = self.router.scrape_forever(self.config.scrape_interval_s)
            self._tasks.append(asyncio.create_task(scrape))
        for live in self.live.values():
            if live.task is None:
                self._spawn(live)
        self._poke()

    async def close(self) -> None:
        """Stop everything; trajectories still running are lost (and restarted by the next
        ``open``: the journal has them running)."""
        tasks = [*self._tasks, *(lv.task for lv in self.live.values() if lv.task)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._write_snapshot()
        if self._journal:
            self._journal.close()
        if self._log:
            self._log.close()

    def now_s(self) -> float:
        """The run clock: seconds since the run first started (across restarts)."""
        return time.time() - self._t0_unix_s

    def _run_t(self, monotonic_s: float) -> float:
        return max(0.0, self.now_s() - (time.monotonic() - monotonic_s))

    # --- admission and episodes ------------------------------------------------------------

    async def _admit_forever(self) -> None:
        g = self.config.rules.group_size
        while True:
            await self._admit_wake.wait()
            self._admit_wake.clear()
            while self.ledger.capacity() >= g:
                group_id = len(self.ledger.groups)
                first = self.ledger.totals.admitted
                ids = tuple(f"g{group_id:06d}-{k}" for k in range(g))
                self.ledger.admit(ids, self.now_s())
                self._write("admit", group_id=group_id, traj_ids=list(ids))
                for k, traj_id in enumerate(ids):
                    live = self.live[traj_id] = _Live(traj_id, first + k, group_id)
                    self._spawn(live)

    def _spawn(self, live: _Live) -> None:
        live.task = asyncio.create_task(self._episode(live), name=live.traj_id)

    async def _episode(self, live: _Live) -> None:
        sampling = self.config.sampling
        if sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + live.index)
        env_seed = self.config.seed * 1_000_003 + live.group_id
        try:
            traj = await run_episode(
                self.router,
                self.make_env(),
                self.tok,
                live.traj_id,
                sampling,
                self.config.limits,
                seed=env_seed,
                hooks=self,
            )
        except Exception as err:  # a bug or a refused request: this trajectory, not the run
            if live.cancelled:
                return
            log.exception("trajectory %s failed", live.traj_id)
            traj = Trajectory(live.traj_id, end_reason="agent_error", info={"error": str(err)})
        if not live.cancelled:  # a cancelled episode that went on finishes nothing
            self._finish(traj)

    def _running(self, traj_id: str) -> _Live:
        """The live trajectory a hook is about; a cancelled episode's hook stops it."""
        live = self.live[traj_id]
        if live.cancelled:
            raise asyncio.CancelledError(f"{traj_id}: restarted or dropped by an update")
        return live

    # EpisodeHooks
    def turn_sent(self, traj_id: str, turn: int, context_tokens: int) -> None:
        live = self._running(traj_id)
        self.ledger.sent(traj_id)
        live.phase, live.context_tokens = TrajPhase.PREFILL, context_tokens

    def model_turn_ended(self, traj_id: str, turn: int, out: TurnOutput) -> None:
        live = self._running(traj_id)
        self.generated_tokens += len(out.token_ids)
        spans = _spans(out.versions)
        for version, n in spans:
            self.ledger.generated(traj_id, n, version)
        now = self.now_s()
        self.ledger.turn_ended(traj_id, now, last=False)
        self.observer.turn_ended(len(out.token_ids))
        self._write("turn", traj_id=traj_id, spans=spans)
        live.phase, live.env_started_s = TrajPhase.ENV, now
        live.context_tokens += len(out.token_ids)
        live.turns_done += 1  # in env: the turns left are those after its tool call

    def env_step_ended(
        self, traj_id: str, record: TurnRecord, observation_tokens: int | None
    ) -> None:
        live = self._running(traj_id)
        self.log_record(
            TurnEnded.model_construct(
                t=self._run_t(record.ended_s),
                traj_id=traj_id,
                turn=live.turns_done - 1,
                prompt_tokens=record.prompt_tokens,
                output_tokens=record.output_tokens,
                started_t=self._run_t(record.started_s),
                env_s=record.env_s if observation_tokens is not None else None,
                served_by=record.served_by,
                prefilled_by=record.prefilled_by,
                continuations=record.continuations,
                finish_reason=record.finish_reason,
            )
        )
        if observation_tokens is None:
            return
        self.observer.env_step(record.env_s, observation_tokens)
        self._write(
            "env", traj_id=traj_id, env_s=record.env_s, observation_tokens=observation_tokens
        )
        live.phase = TrajPhase.QUEUED
        live.context_tokens += observation_tokens

    def _finish(self, traj: Trajectory) -> None:
        now = self.now_s()
        traj, doc = _checked(traj)  # before the books move: what is journaled is readable
        rec = self.ledger.trajectories[traj.traj_id]
        self.ledger.finish(traj.traj_id, now)
        self._write("finish", traj_id=traj.traj_id, trajectory=doc)
        self._finished_books(traj)
        del self.live[traj.traj_id]
        rules = self.config.rules
        prompt = _prompt_tokens(traj)
        self.log_record(
            TrajectoryFinished.model_construct(
                t=now,
                traj_id=traj.traj_id,
                batch_id=rec.group_id // rules.groups_per_batch
                if rules.batching is Batching.IN_ORDER
                else None,
                num_turns=len(traj.turns),
                output_tokens=traj.generated_tokens,
                min_policy_version=min((v for v in traj.versions if v >= 0), default=0),
                reward=traj.reward,
                end_reason=traj.end_reason,
                prompt_tokens=prompt,
                observation_tokens=len(traj.token_ids) - traj.generated_tokens - prompt,
                started_t=rec.admitted_s,
            )
        )
        self._batch_completed(now)
        self._poke()

    def _batch_completed(self, now: float) -> None:
        """The trainer's signal: the next batch became complete (logged once per batch;
        the snapshot's ``next_batch.groups_needed`` is 0 from now until it is taken)."""
        batch_id = self.ledger.totals.batches
        if self.ledger.batch_ready() and batch_id > self._completed_logged:
            self._completed_logged = batch_id
            self.log_record(
                BatchCompleted.model_construct(
                    t=now,
                    batch_id=batch_id,
                    started_t=self._batch_started_t,
                    predicted_s=self._batch_predicted_s,
                )
            )
            self._batch_completed_t = now

    def _finished_books(self, traj: Trajectory) -> None:
        self.finished[traj.traj_id] = traj
        self.observer.trajectory_finished(len(traj.turns), _prompt_tokens(traj))

    def _lose(self, traj_id: str) -> None:
        rec = self.ledger.trajectories[traj_id]
        wasted = self.ledger.lost(traj_id)
        self._write("lost", traj_id=traj_id, wasted_tokens=wasted)
        self.log_record(
            TrajectoryLost.model_construct(
                t=self.now_s(),
                traj_id=traj_id,
                reason="manager_restart",
                wasted_tokens=wasted,
                turns_done=self._turns_done.pop(traj_id, 0),
            )
        )
        self.live[traj_id] = _Live(traj_id, rec.index, rec.group_id)

    # --- batches and updates ---------------------------------------------------------------

    async def next_batch(self, batch_id: int | None = None) -> RolloutBatch:
        """The trainer's next batch, once the ledger says it is complete; or batch
        ``batch_id`` again, when it was taken already (a trainer that resumes from its
        checkpoint asks for the batch of its next step: the spool holds it)."""
        if batch_id is not None and batch_id < self.ledger.totals.batches:
            return self.spool.read(batch_id)
        if batch_id is not None and batch_id > self.ledger.totals.batches:
            raise ValueError(f"batch {batch_id}: the next batch is {self.ledger.totals.batches}")
        while not self.ledger.batch_ready():
            self._batch_wake.clear()
            await self._batch_wake.wait()
        return self._take_batch()

    def _take_batch(self) -> RolloutBatch:
        now = self.now_s()
        ids = [t for g in self.ledger.next_batch_groups() for t in self.ledger.groups[g].members]
        trajs = tuple(self.finished[t] for t in ids)  # before the books move
        taken = self.ledger.take_batch(now)
        assert list(taken.traj_ids) == ids
        for traj_id in ids:
            del self.finished[traj_id]
        batch = RolloutBatch(
            batch_id=taken.batch_id,
            policy_version=taken.version,
            trajectories=trajs,
            group_ids=tuple(self.ledger.trajectories[t].group_id for t in taken.traj_ids),
            off_policy_tokens=taken.off_policy_tokens,
            max_staleness_versions=taken.max_staleness_versions,
            mean_staleness_versions=taken.mean_staleness_versions,
        )
        self.spool.write(batch)
        self._write("batch", batch_id=taken.batch_id, traj_ids=list(taken.traj_ids))
        self.log_record(batch_consumed_record(now, taken))
        done_t = self._batch_completed_t
        if self.on_batch_completed is not None and done_t is not None:
            measured_s = done_t - self._batch_started_t
            self.on_batch_completed(self._batch_predicted_s, measured_s, self._batch_predicted_tag)
        self._batch_started_t, self._batch_predicted_s, self._batch_completed_t = now, None, None
        self._write_snapshot()  # the next decision sees the batch just begun, not the last
        self._batch_completed(now)  # more complete groups may be waiting already
        self._poke()
        return batch

    def note_prediction(self, decided_s: float, predicted_s: float, tag: float = 1.0) -> None:
        """A decision at run time ``decided_s`` predicted the batch being gathered complete
        ``predicted_s`` later (``pearl.core.decision.Decision.predicted_s``): the first such
        prediction of a batch is its ``batch_completed.predicted_s``, the batch's duration
        as predicted, which ``pearl analyze`` scores against the actual one. A decision made
        before the batch began (on the snapshot of the one before) predicts nothing of it.
        ``tag`` (what the prediction was made with: pearl run's calibration factor) comes
        back with the batch to ``on_batch_completed``."""
        if decided_s < self._batch_started_t:  # on a snapshot from before the batch began
            return
        first = self._batch_predicted_s is None and not self.ledger.batch_ready()
        if first and math.isfinite(predicted_s):
            self._batch_predicted_s = decided_s + predicted_s - self._batch_started_t
            self._batch_predicted_tag = tag

    async def updated(self, version: int) -> PastBoundOutcome:
        """The trainer's update made ``version``, now on the engines: the past-bound rule."""
        now = self.now_s()
        outcome = self.ledger.updated(now, version)
        self._write("updated", version=version)
        if not outcome.empty:
            self.log_record(past_bound_record(now, outcome, self.config.rules.past_bound))
        gone = [*outcome.restarted, *outcome.dropped]
        cancelled = [task for t in gone if t in self.live and (task := self.live[t].task)]
        for t in gone:
            if t in self.live:
                self.live[t].cancelled = True
        for task in cancelled:
            task.cancel()
        await asyncio.gather(*cancelled, return_exceptions=True)
        if not self.ledger.batch_ready():  # it lost a group: complete again later
            self._completed_logged = min(self._completed_logged, self.ledger.totals.batches - 1)
        for traj_id in outcome.dropped:
            self.live.pop(traj_id, None)
            self.finished.pop(traj_id, None)
        for traj_id in outcome.restarted:
            self.finished.pop(traj_id, None)
            rec = self.ledger.trajectories[traj_id]
            live = self.live[traj_id] = _Live(traj_id, rec.index, rec.group_id)
            self._spawn(live)
        self._poke()
        return outcome

    async def _spool_forever(self, poll_s: float = 0.05) -> None:
        """Requests of a trainer in another process (``batches.SpoolClient``): every
        update first, then the batch wanted next once it is complete (never waiting for
        it here: an update may be what completes it). A run has one trainer: in-process
        or on the spool, not both (a ``want`` is served to whoever asks next)."""
        while True:
            wants, updates = self.spool.requests()
            for version in updates:
                if version > self.ledger.version:
                    await self.updated(version)
            if self.ledger.totals.batches in wants and self.ledger.batch_ready():
                self._take_batch()
            await asyncio.sleep(poll_s)

    # --- what the predictor reads ----------------------------------------------------------

    def snapshot(self) -> WorkloadSnapshot:
        now = self.now_s()
        turns = self.config.limits.max_turns
        default = tuple((turns - k + 1) / 2 for k in range(turns))  # uniform over 1..max
        turns_left = self.observer.turns_left(default)
        grouped = self.config.rules.batching is Batching.FIRST_COMPLETED
        if grouped:
            tool_left = self.observer.tool_left(self.config.env_latency_s)
        else:  # the simulator's in-order rule: the observed mean, less the time spent
            tool_left = mean_tool_left(self.observer.mean_env_s(self.config.env_latency_s))
        progress_of = [
            progress(
                lv.traj_id,
                lv.phase,
                lv.context_tokens,
                0,
                lv.turns_done,
                now - lv.env_started_s if lv.phase is TrajPhase.ENV else 0.0,
                f"g{lv.group_id}" if grouped else None,
                turns_left,
                tool_left,
            )
            for lv in self.live.values()
        ]
        return snapshot(self.ledger, progress_of, self.observer, self.ledger.version)

    def _write_snapshot(self) -> None:
        write_text_atomic(self.run_dir / WORKLOAD, self.snapshot().model_dump_json() + "\n")

    async def _snapshot_forever(self) -> None:
        while True:
            self._write_snapshot()
            await asyncio.sleep(self.config.snapshot_interval_s)

    # --- journal ---------------------------------------------------------------------------

    def _write(self, event: str, **fields: Any) -> None:
        assert self._journal is not None
        self._journal.write(event, self.now_s(), **fields)

    def log_record(self, record: Any) -> None:
        """A record into the run log (the manager's writer: one per run log)."""
        if self._log is not None:
            self._log.write(record)

    def _replay(self, events: list[dict[str, Any]]) -> None:
        """Rebuild the books from the journal (``journal.py``'s table)."""
        path = self.run_dir / JOURNAL
        first = events[0]
        if first["e"] != "start":
            raise JournalError(f"{path}:1: the first event is {first['e']!r}, not 'start'")
        for name, value in identity(self.config).items():
            if first.get(name) != value:
                raise JournalError(
                    f"{path}:1: field '{name}': the run has {first.get(name)}, this "
                    f"configuration {value} (a run resumes with the configuration it began with)"
                )
        started = first.get("run_started_unix_s")
        if not isinstance(started, int | float) or not 0 <= started < MAX_UNIX_S:
            raise JournalError(f"{path}:1: field 'run_started_unix_s': not a time: {started!r}")
        self._t0_unix_s = float(started)
        led = self.ledger
        for number, ev in enumerate(events[1:], start=2):
            try:
                self._replay_one(led, ev)
            except (KeyError, ValueError, TypeError) as err:
                raise JournalError(f"{path}:{number}: {ev['e']}: {err}") from None

    def _replay_one(self, led: RolloutLedger, doc: dict[str, Any]) -> None:
        ev = event_of(doc)
        if isinstance(ev, AdmitEvent):
            led.admit(ev.traj_ids, ev.t)
            for traj_id in ev.traj_ids:
                self._turns_done[traj_id] = 0
        elif isinstance(ev, TurnEvent):
            led.sent(ev.traj_id)
            for version, n in ev.spans:
                led.generated(ev.traj_id, n, version)
            led.turn_ended(ev.traj_id, ev.t, last=False)
            self._turns_done[ev.traj_id] += 1
            self.observer.turn_ended(sum(n for _, n in ev.spans))
        elif isinstance(ev, EnvEvent):
            self.observer.env_step(ev.env_s, ev.observation_tokens)
        elif isinstance(ev, FinishEvent):
            traj = trajectory_of(ev.trajectory, "trajectory")
            led.finish(ev.traj_id, ev.t)
            self._finished_books(traj)
        elif isinstance(ev, BatchEvent):
            taken = led.take_batch(ev.t)
            if taken.batch_id != ev.batch_id or taken.traj_ids != ev.traj_ids:
                raise ValueError(f"batch {ev.batch_id} does not replay to the same groups")
            for traj_id in taken.traj_ids:
                self.finished.pop(traj_id)
            self._batch_started_t = ev.t
            self._completed_logged = taken.batch_id  # (the next one: logged when complete)
        elif isinstance(ev, UpdatedEvent):
            outcome = led.updated(ev.t, ev.version)
            for traj_id in (*outcome.restarted, *outcome.dropped):
                self.finished.pop(traj_id, None)
                self._turns_done[traj_id] = 0
        elif isinstance(ev, LostEvent):
            led.lost(ev.traj_id)
            self._turns_done[ev.traj_id] = 0


MAX_UNIX_S = 2**40  # a wall time, in seconds since 1970 (the year 36812)


def _checked(traj: Trajectory) -> tuple[Trajectory, dict[str, Any]]:
    """The trajectory as it can be journaled and trained on, and its journal document: one
    that cannot be trained on (``trajectory_problem``: an engine's answer was inconsistent
    or impossible) ends as ``agent_error`` with no tokens; an ``info`` that is not JSON is
    kept as its repr."""
    problem = trajectory_problem(traj)
    if problem is not None:
        error = f"trajectory {traj.traj_id}: {problem[0]}: {problem[1]}"
        log.error("%s", error)
        traj = Trajectory(traj.traj_id, end_reason="agent_error", info={"error": error})
    try:
        return traj, trajectory_doc(traj)
    except PydanticSerializationError:
        traj = dataclasses.replace(traj, info={"info_repr": repr(traj.info)[:4000]})
        return traj, trajectory_doc(traj)


def _report_death(task: asyncio.Task[None]) -> None:
    """A background task of the manager that ended other than by being cancelled."""
    if not task.cancelled() and task.exception() is not None:
        log.error("rollout manager task died", exc_info=task.exception())


def _prompt_tokens(traj: Trajectory) -> int:
    """The tokens of the trajectory's prompt (all of it, when no turn ran)."""
    return traj.turns[0].prompt_tokens if traj.turns else len(traj.token_ids)


def _spans(versions: list[int]) -> list[tuple[int, int]]:
    """Runs of equal versions: ``[(version, tokens), ...]``."""
    out: list[tuple[int, int]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out
