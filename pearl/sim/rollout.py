"""The simulator's trajectories: its adapter over the rollout ledger (``pearl.rollout``).

The ledger keeps the books (admission, groups, batches, versions, the staleness bound);
this module keeps what only a simulator has: each trajectory's sampled future (its
``TrajectorySpec``), its turn, context and requests. What a coordinator's predictor would
observe (the turn statistics, a running tool's time left, each trajectory's progress, the
snapshot) is ``pearl.rollout.observed``, which the real rollout manager runs too: this
module reports every completed turn, tool step and finished trajectory to its
``TurnObserver`` and builds the snapshot with that module's ``progress`` and ``snapshot``.

Trajectory ``j`` of the seeded stream (``trajectory_stream``) is sample ``j % g`` of group
``j // g`` (g = ``group_size``); a group's samples share its first sample's prompt length.
Groups are admitted whole, in stream order, as the ledger's capacity allows. A restarted
trajectory (``past_bound: restart``) draws a fresh sample of the same prompt from its own
generator, so restarts never shift the stream that every policy of a seed shares.

A turn is one request: its prompt is the context so far (prompt, every earlier output
and every observation up to this turn), its output the turn's sampled length. A request
taken off an instance (drain, migration, a reclaimed node) continues elsewhere as a new request
whose prompt includes the tokens generated so far: nothing is lost or generated twice.
Every generated token is attributed to the weights' version that produced it: when it
leaves an instance, when its turn ends, and at each update for the tokens on an engine
(``attribute_on_engine``, before the engines load the new weights).

Invariants: every admitted trajectory is running (``in_flight``), finished, consumed or
dropped in the ledger; ``request_id`` is the trajectory's one live request (an event of
any other request of it is stale and ignored).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from pearl.core.workload import TrajPhase, WorkloadSnapshot
from pearl.rollout import observed
from pearl.rollout.ledger import ConsumedBatch, PastBoundOutcome, RolloutLedger
from pearl.rollout.observed import TurnObserver
from pearl.rollout.rules import Batching, RolloutRules
from pearl.serving.requests import Request
from pearl.sim.trajectories import TrajectoryModel, TrajectorySpec, sample_trajectories

_CHUNK = 256  # trajectories drawn from the seeded stream at a time


@dataclass
class Trajectory:
    traj_id: str
    index: int  # position in the run's stream
    group_id: int
    spec: TrajectorySpec
    started_s: float
    turn: int = 0
    context_tokens: int = 0  # prompt of the current turn (tokens generated so far excluded)
    generated_tokens: int = 0  # of the current turn, on instances it has left
    attributed_tokens: int = 0  # of the current turn, attributed to a version
    phase: TrajPhase = TrajPhase.QUEUED
    env_started_s: float = 0.0
    num_requests: int = 0
    request_id: str = ""  # its live request

    def next_request(self) -> Request:
        self.num_requests += 1
        rid = f"{self.traj_id}.{self.turn}.{self.num_requests}"
        self.request_id = rid
        out = self.spec.output_tokens[self.turn] - self.generated_tokens
        return Request(rid, self.traj_id, self.context_tokens + self.generated_tokens, out)


@dataclass
class BatchRecord:
    """One batch as the run log reports it: in-order, from its first trajectory's start;
    first-completed, from the previous batch's consumption."""

    batch_id: int
    started_s: float | None = None
    completed_s: float | None = None
    predicted_s: float | None = None


@dataclass
class Rollout:
    """The seeded trajectory stream, the ledger, and every trajectory running."""

    model: TrajectoryModel
    rng: np.random.Generator
    restart_rng: np.random.Generator
    rules: RolloutRules
    max_context_tokens: int
    mean_env_s: float  # the model's mean tool latency, until the run has observed some
    ledger: RolloutLedger = field(init=False)
    in_flight: dict[str, Trajectory] = field(default_factory=dict)
    waiting: dict[str, Trajectory] = field(default_factory=dict)  # finished, not consumed
    batches: dict[int, BatchRecord] = field(default_factory=dict)
    # what a coordinator observes: every completed turn, tool step and finished
    # trajectory (dropped ones included)
    observer: TurnObserver = field(default_factory=TurnObserver)
    num_started: int = 0
    aborted_tokens: int = 0  # of turns aborted by a restart or a drop
    _stream: Iterator[TrajectorySpec] | None = None
    _restarts: Iterator[TrajectorySpec] | None = None

    def __post_init__(self) -> None:
        self.ledger = RolloutLedger(self.rules)
        if self.rules.batching is Batching.FIRST_COMPLETED:
            self.batches[0] = BatchRecord(0, started_s=0.0)

    @property
    def in_order(self) -> bool:
        return self.rules.batching is Batching.IN_ORDER

    @property
    def output_tokens(self) -> int:
        """Of completed turns."""
        return self.observer.sum_output_tokens

    # --- admission -------------------------------------------------------------------------

    def startable(self, version: int | None = None) -> int:
        """How many more trajectories the rules admit now, or at weights ``version``."""
        return self.ledger.capacity(version)

    def start_group(self, now_s: float) -> list[Trajectory]:
        if self._stream is None:
            self._stream = trajectory_stream(
                self.model, self.rng, self.max_context_tokens, self.rules.group_size
            )
        g = self.rules.group_size
        j0 = self.num_started
        trajs = [
            Trajectory(f"t{j:07d}", j, j // g, next(self._stream), now_s) for j in range(j0, j0 + g)
        ]
        self.ledger.admit(tuple(t.traj_id for t in trajs), now_s)
        for traj in trajs:
            traj.context_tokens = traj.spec.prompt_tokens
            self.in_flight[traj.traj_id] = traj
        self.num_started += g
        if self.in_order:
            batch_id = j0 // self.rules.batch_trajectories
            batch = self.batches.setdefault(batch_id, BatchRecord(batch_id))
            if batch.started_s is None:
                batch.started_s = now_s
        return trajs

    # --- tokens and turns ------------------------------------------------------------------

    def _attribute(self, traj: Trajectory, turn_tokens: int, version: int) -> None:
        """The current turn has generated ``turn_tokens``; the new ones are ``version``'s."""
        self.ledger.generated(traj.traj_id, turn_tokens - traj.attributed_tokens, version)
        traj.attributed_tokens = turn_tokens

    def turn_generated(self, traj: Trajectory, num_tokens: int, version: int) -> None:
        """Tokens of the current turn generated on an instance it is leaving or has left."""
        traj.generated_tokens += num_tokens
        self._attribute(traj, traj.generated_tokens, version)

    def attribute_on_engine(self, traj: Trajectory, on_engine_tokens: int, version: int) -> None:
        """Before an update's weights load: the tokens of its live request on an engine."""
        self._attribute(traj, traj.generated_tokens + on_engine_tokens, version)

    def sent(self, traj: Trajectory) -> None:
        """Its live request reached an engine's queue (or was parked for one)."""
        self.ledger.sent(traj.traj_id)

    def finish_turn(self, traj: Trajectory, now_s: float, version: int) -> float | None:
        """The turn's output is complete: the tool's end time, or None if it was the last."""
        out = traj.spec.output_tokens[traj.turn]
        self._attribute(traj, out, version)
        traj.context_tokens += out
        traj.generated_tokens = traj.attributed_tokens = 0
        self.observer.turn_ended(out)
        last = traj.turn + 1 == traj.spec.num_turns
        self.ledger.turn_ended(traj.traj_id, now_s, last)
        if last:
            return None
        latency_s = traj.spec.tool_latency_s[traj.turn]
        traj.turn += 1
        new = traj.spec.new_tokens[traj.turn]
        self.observer.env_step(latency_s, new)
        traj.context_tokens += new
        traj.phase = TrajPhase.ENV
        traj.env_started_s = now_s
        return now_s + latency_s

    def finish(self, traj: Trajectory, now_s: float) -> BatchRecord | None:
        """Its last turn ended; the batch record it completed, if any."""
        del self.in_flight[traj.traj_id]
        self.waiting[traj.traj_id] = traj
        self.observer.trajectory_finished(traj.spec.num_turns, traj.spec.prompt_tokens)
        if not self.in_order:
            return self.completed(now_s)
        batch_id = traj.index // self.rules.batch_trajectories
        if not self.ledger.in_order_batch_complete(batch_id):
            return None
        batch = self.batches[batch_id]
        batch.completed_s = now_s
        return batch

    def completed(self, now_s: float) -> BatchRecord | None:
        """First-completed: the open batch record, stamped the first time the next batch is
        complete (after a trajectory finished, a batch was taken or an update ended)."""
        if self.in_order:
            return None
        batch_id = self.ledger.totals.batches
        batch = self.batches.get(batch_id)
        if batch is None or batch.completed_s is not None or not self.ledger.batch_ready():
            return None
        batch.completed_s = now_s
        return batch

    # --- batches and updates ---------------------------------------------------------------

    def take_batch(self, now_s: float) -> ConsumedBatch:
        batch = self.ledger.take_batch(now_s)
        for traj_id in batch.traj_ids:
            del self.waiting[traj_id]
        if not self.in_order:
            following = BatchRecord(batch.batch_id + 1, started_s=now_s)
            self.batches[following.batch_id] = following
        return batch

    def updated(self, now_s: float, version: int) -> tuple[PastBoundOutcome, list[str]]:
        """An update ended: the ledger's past-bound rule. Restarted trajectories are reset
        to their prompt with a fresh sample, dropped ones leave; with the outcome, the live
        requests of both, which the world must abort."""
        outcome = self.ledger.updated(now_s, version)
        open_batch = self.batches.get(self.ledger.totals.batches)
        if open_batch is not None and not self.ledger.batch_ready():
            open_batch.completed_s = None  # it lost a group: complete again later
        stale = []
        for traj_id in (*outcome.dropped, *outcome.restarted):
            traj = self.in_flight.get(traj_id)
            if traj is not None and traj.request_id:
                stale.append(traj.request_id)
                self.aborted_tokens += traj.attributed_tokens
        for traj_id in outcome.dropped:
            if self.in_flight.pop(traj_id, None) is None:
                del self.waiting[traj_id]
        for traj_id in outcome.restarted:
            traj = self.in_flight.get(traj_id)
            if traj is None:  # it had finished: it runs again
                traj = self.in_flight[traj_id] = self.waiting.pop(traj_id)
            self._restart(traj, now_s)
        return outcome, stale

    def _restart(self, traj: Trajectory, now_s: float) -> None:
        if self._restarts is None:
            self._restarts = trajectory_stream(
                self.model, self.restart_rng, self.max_context_tokens
            )
        fresh = next(self._restarts)  # a fresh sample of the same prompt
        prompt = traj.spec.prompt_tokens
        traj.spec = fitted(
            TrajectorySpec(prompt, fresh.new_tokens, fresh.output_tokens, fresh.tool_latency_s),
            self.max_context_tokens,
        )
        traj.turn = 0
        traj.context_tokens = traj.spec.prompt_tokens
        traj.generated_tokens = traj.attributed_tokens = 0
        traj.phase = TrajPhase.QUEUED
        traj.started_s = now_s

    # --- what the predictor sees -----------------------------------------------------------

    def snapshot(
        self,
        now_s: float,
        version: int,
        turns_left: tuple[float, ...],
        update_left_s: float = 0.0,
    ) -> WorkloadSnapshot:
        """The running trajectories as the predictor sees them, and those the rules admit
        once the weights are ``version`` (``update_left_s`` from now, when an update runs):
        ``pearl.rollout.observed``'s rules over what a coordinator would know of each
        trajectory (its turns done, its context, how long its tool has run), not its
        sampled future.

        In-order batches ask the old question with the old snapshot (so their runs stay as
        they were): every trajectory, a tool's time left its mean less the time spent, and
        what the running update will admit counted as not started. First-completed batches
        ask for the next batch (``NextBatch``): trajectories carry their groups; a tool's
        time left is the mean of the observed latencies longer than the time spent, less
        that time; and what the update will admit begins ``update_left_s`` from now."""
        obs = self.observer
        if self.in_order:
            tool_left = observed.mean_tool_left(obs.mean_env_s(self.mean_env_s))
        else:
            tool_left = obs.tool_left(self.mean_env_s)
        grouped = not self.in_order
        progress = [
            observed.progress(
                t.traj_id,
                t.phase,
                t.context_tokens + t.generated_tokens,
                t.generated_tokens,
                t.turn,
                now_s - t.env_started_s,
                f"g{t.group_id}" if grouped else None,
                turns_left,
                tool_left,
            )
            for t in self.in_flight.values()
        ]
        return observed.snapshot(
            self.ledger, progress, obs, version, update_left_s, not_started_turns=turns_left[0]
        )


def fitted(spec: TrajectorySpec, max_context_tokens: int) -> TrajectorySpec:
    """The spec with its prompt clipped so that the whole trajectory fits the context."""
    excess = spec.total_tokens - max_context_tokens
    if excess <= 0:
        return spec
    prompt = max(1, spec.prompt_tokens - excess)
    return TrajectorySpec(prompt, spec.new_tokens, spec.output_tokens, spec.tool_latency_s)


def trajectory_stream(
    model: TrajectoryModel,
    rng: np.random.Generator,
    max_context_tokens: int,
    group_size: int = 1,
) -> Iterator[TrajectorySpec]:
    """The run's trajectories in order, drawn in chunks: the samples of each group of
    ``group_size`` share its first sample's prompt length, and each is clipped to fit the
    model's context. The same generator state gives the same stream."""
    index = 0
    prompt = 0
    while True:
        for spec in sample_trajectories(model, rng, _CHUNK):
            if index % group_size == 0:
                prompt = spec.prompt_tokens
            elif spec.prompt_tokens != prompt:
                spec = TrajectorySpec(
                    prompt, spec.new_tokens, spec.output_tokens, spec.tool_latency_s
                )
            index += 1
            yield fitted(spec, max_context_tokens)
