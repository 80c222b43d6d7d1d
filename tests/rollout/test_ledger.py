"""The rollout ledger under random runs (hypothesis): conservation, the staleness bound,
whole groups in every batch, admission within capacity; and the rules on hand-made cases."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pearl.rollout.ledger import RUNNING, ConsumedBatch, RolloutLedger, TrajState
from pearl.rollout.rules import Batching, PastBound, RolloutRules


class LedgerRun(RuleBasedStateMachine):
    """A world that drives the ledger at random: admits what capacity allows, sends turns,
    generates tokens under the current weights, ends turns, takes batches, updates."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger: RolloutLedger
        self.now_s = 0.0
        self.next_id = 0
        self.batches: list[ConsumedBatch] = []
        self.consumed: set[str] = set()
        self.taken_back = 0  # finished trajectories started again by updates
        self.engine_version = 0
        self.stragglers = False

    @initialize(
        group_size=st.sampled_from([1, 2, 4]),
        groups_per_batch=st.integers(1, 3),
        staleness=st.integers(0, 2),
        max_in_flight=st.one_of(st.none(), st.integers(4, 16)),
        batching=st.sampled_from(list(Batching)),
        past_bound=st.sampled_from(list(PastBound)),
        initial_version=st.integers(0, 3),
        stragglers=st.booleans(),
    )
    def start(
        self,
        group_size: int,
        groups_per_batch: int,
        staleness: int,
        max_in_flight: int | None,
        batching: Batching,
        past_bound: PastBound,
        initial_version: int,
        stragglers: bool,
    ) -> None:
        self.stragglers = stragglers  # every third trajectory moves only in advance_one
        if max_in_flight is not None:
            max_in_flight = max(max_in_flight, group_size)
        self.ledger = RolloutLedger(
            RolloutRules(
                batch_trajectories=group_size * groups_per_batch,
                max_staleness_versions=staleness,
                group_size=group_size,
                max_in_flight=max_in_flight,
                batching=batching,
                past_bound=past_bound,
                initial_version=initial_version,
            )
        )
        self.engine_version = initial_version

    def _running(self, *states: TrajState) -> list[str]:
        return sorted(t for t, r in self.ledger.trajectories.items() if r.state in states)

    @precondition(lambda self: self.ledger.capacity() > 0)
    @rule()
    def admit(self) -> None:
        g = self.ledger.rules.group_size
        before = self.ledger.capacity()
        ids = tuple(f"t{self.next_id + i}" for i in range(g))
        self.next_id += g
        self.ledger.admit(ids, self.now_s)
        assert self.ledger.capacity() <= before - g or self.ledger.capacity() == 0

    def _advance(self, traj_id: str, tokens: int, last: bool) -> None:
        """One move of one trajectory: send its turn, or generate and end it."""
        led = self.ledger
        if led.state_of(traj_id) in (TrajState.QUEUED, TrajState.IN_ENV):
            led.sent(traj_id)
            return
        led.generated(traj_id, tokens + 1, self.engine_version)
        self.now_s += 1.0
        led.turn_ended(traj_id, self.now_s, last)

    @rule(data=st.data(), tokens=st.integers(0, 50), last=st.booleans())
    def advance_one(self, data: st.DataObject, tokens: int, last: bool) -> None:
        running = self._running(*RUNNING)
        if running:
            self._advance(data.draw(st.sampled_from(running)), tokens, last)

    @rule(data=st.data())
    def env_ends_one(self, data: st.DataObject) -> None:
        """A real environment ends an episode after its tool step (or before a turn)."""
        waiting = self._running(TrajState.IN_ENV, TrajState.QUEUED)
        if waiting:
            self.now_s += 1.0
            self.ledger.finish(data.draw(st.sampled_from(waiting)), self.now_s)

    @rule(data=st.data())
    def lose_one(self, data: st.DataObject) -> None:
        """The world lost a running trajectory (a restart of the rollout manager)."""
        running = self._running(*RUNNING)
        if running:
            traj_id = data.draw(st.sampled_from(running))
            tokens = self.ledger.trajectories[traj_id].tokens
            before = self.ledger.totals.wasted_tokens
            assert self.ledger.lost(traj_id) == tokens
            rec = self.ledger.trajectories[traj_id]
            assert rec.state is TrajState.QUEUED and rec.tokens == 0
            assert rec.head_version == self.ledger.version
            assert self.ledger.totals.wasted_tokens == before + tokens

    @rule(lasts=st.lists(st.booleans(), min_size=1, max_size=8))
    def advance_all(self, lasts: list[bool]) -> None:
        """A tick: admit what capacity allows, then every running trajectory moves once
        (some end their last turn)."""
        while self.ledger.capacity() > 0:
            self.admit()
        for i, traj_id in enumerate(self._running(*RUNNING)):
            if not (self.stragglers and int(traj_id[1:]) % 3 == 0):
                self._advance(traj_id, i % 7, lasts[i % len(lasts)])
        if self.ledger.batch_ready():  # the trainer takes a batch; its update ends
            self.take_batch()
            self.update()

    @precondition(lambda self: self.ledger.batch_ready())
    @rule()
    def take_batch(self) -> None:
        batch = self.ledger.take_batch(self.now_s)
        r = self.ledger.rules
        assert len(batch.traj_ids) == r.batch_trajectories
        groups = [self.ledger.trajectories[t].group_id for t in batch.traj_ids]
        assert all(groups.count(g) == r.group_size for g in set(groups)), "whole groups only"
        assert not set(batch.traj_ids) & self.consumed, "consumed twice"
        assert batch.max_staleness_versions <= r.max_staleness_versions
        self.consumed |= set(batch.traj_ids)
        self.batches.append(batch)
        event(f"{min(len(self.batches), 3)}+ batches taken")

    @precondition(lambda self: self.ledger.totals.batches > self.updates_done)
    @rule()
    def update(self) -> None:
        # an update follows a batch; the engines load the new weights at its end
        version = self.ledger.version + 1
        outcome = self.ledger.updated(self.now_s, version)
        self.taken_back += outcome.taken_back
        self.engine_version = version
        for traj_id in outcome.interrupted:
            assert self.ledger.trajectories[traj_id].head_version == version
        for traj_id in outcome.restarted:
            rec = self.ledger.trajectories[traj_id]
            assert rec.state is TrajState.QUEUED and rec.tokens == 0
        for traj_id in outcome.dropped:
            assert self.ledger.state_of(traj_id) is TrajState.DROPPED
        if self.ledger.rules.batching is Batching.IN_ORDER:
            assert outcome.empty
        event(f"{min(self.updates_done, 3)}+ updates")
        for name in ("interrupted", "restarted", "dropped"):
            if getattr(outcome, name):
                event(f"an update {name} trajectories")

    @property
    def updates_done(self) -> int:
        return self.ledger.version - self.ledger.rules.initial_version

    @invariant()
    def books_balance(self) -> None:
        self.ledger.check()
        bound = self.ledger.rules.max_staleness_versions
        for t in self.ledger.unconsumed():  # nothing waiting that the bound has passed
            assert self.ledger.version - t.head_version <= bound
        assert all(self.ledger.state_of(t) is TrajState.CONSUMED for t in self.consumed)
        t = self.ledger.totals
        assert t.consumed_tokens >= t.off_policy_tokens >= 0

    @invariant()
    def groups_needed_at_take_is_what_the_pending_updates_leave(self) -> None:
        led = self.ledger
        after = copy.deepcopy(led)
        while after.totals.batches > after.version - after.rules.initial_version:
            after.updated(self.now_s, after.version + 1)
        assert led.groups_needed_at_take() == after.groups_needed()
        if after.version > led.version and led.groups_needed_at_take() > led.groups_needed():
            event("a pending update will take a complete group back")

    @invariant()
    def admission_within_the_rule(self) -> None:
        r = self.ledger.rules
        led = self.ledger
        if r.max_in_flight is not None:
            # a finished trajectory that an update starts again runs again without being
            # admitted: only those may take running past the cap (no group is admitted
            # while it is reached)
            assert led.num_running <= r.max_in_flight + self.taken_back
        if led.totals.dropped == 0 and led.totals.restarted == 0:  # (lost ones restart)
            updates = led.version - r.initial_version
            limit = (r.max_staleness_versions + updates + 1) * r.batch_trajectories
            assert led.num_accepted + led.num_running <= limit


TestLedgerRun = LedgerRun.TestCase
TestLedgerRun.settings = settings(
    max_examples=300,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# --- the rules on hand-made cases ----------------------------------------------------------


def _ledger(**kw: object) -> RolloutLedger:
    args: dict[str, object] = {"batch_trajectories": 4, "max_staleness_versions": 1}
    args.update(kw)
    return RolloutLedger(RolloutRules(**args))  # type: ignore[arg-type]


def _finish(led: RolloutLedger, traj_id: str, now_s: float, version: int = 0) -> None:
    led.sent(traj_id)
    led.generated(traj_id, 10, version)
    led.turn_ended(traj_id, now_s, last=True)


def test_admission_is_areals_capacity_rule() -> None:
    led = _ledger(group_size=2, max_in_flight=6)
    assert led.capacity() == 6  # min(6 - 0, (1 + 0 + 1) * 4 - 0) = 6
    for i in range(3):
        led.admit((f"a{i}", f"b{i}"), 0.0)
    assert led.capacity() == 0  # max_in_flight binds
    for i in range(3):
        _finish(led, f"a{i}", 1.0)
        _finish(led, f"b{i}", 1.0)
    assert led.capacity() == 2  # (1 + 0 + 1) * 4 - (6 accepted + 0 running) = 2
    led.admit(("x", "y"), 0.0)
    with pytest.raises(ValueError, match="beyond capacity"):
        led.admit(("z", "w"), 0.0)


def test_first_completed_takes_complete_groups_in_completion_order() -> None:
    led = _ledger(group_size=2)
    for g in range(4):
        led.admit((f"g{g}a", f"g{g}b"), 0.0)
    _finish(led, "g2a", 1.0)
    _finish(led, "g0a", 2.0)
    _finish(led, "g2b", 3.0)  # group 2 complete first
    assert led.groups_needed() == 1
    _finish(led, "g3a", 4.0)
    _finish(led, "g3b", 5.0)  # then group 3; group 0 is still missing a sample
    batch = led.take_batch(5.0)
    assert batch.traj_ids == ("g2a", "g2b", "g3a", "g3b")
    assert led.state_of("g0a") is TrajState.FINISHED


def test_in_order_waits_for_its_own_trajectories() -> None:
    led = _ledger(batching=Batching.IN_ORDER)
    for i in range(8):
        led.admit((f"t{i}",), 0.0)
    for i in range(4, 8):
        _finish(led, f"t{i}", 1.0)  # the second batch's: not the next one
    assert led.groups_needed() == 4 and not led.batch_ready()
    assert led.in_order_batch_complete(1) and not led.in_order_batch_complete(0)
    for i in range(4):
        _finish(led, f"t{i}", 2.0)
    assert led.take_batch(2.0).traj_ids == ("t0", "t1", "t2", "t3")
    assert led.batch_ready()  # the second batch was already complete


def test_a_group_the_pending_update_takes_back_is_still_needed() -> None:
    """Batch 1 taken at version 1, its update pending: of the two complete groups for
    batch 2, d's was admitted under version 0, past a bound of 1 once that update makes
    version 2, so the batch, complete now, still needs a group at its take (as the update
    then finds)."""
    led = _ledger(group_size=1, batch_trajectories=2, max_staleness_versions=1)
    for t in ("a", "b", "c", "d"):
        led.admit((t,), 0.0)
    for t in ("a", "b"):
        _finish(led, t, 1.0)
    led.take_batch(1.0)  # a and b; the update on them makes version 1
    _finish(led, "c", 1.5)
    assert led.groups_needed_at_take() == led.groups_needed() == 1  # c is within the bound
    led.updated(2.0, 1)
    led.admit(("e",), 2.0)
    led.admit(("f",), 2.0)
    _finish(led, "e", 3.0, version=1)
    assert led.take_batch(3.0).traj_ids == ("c", "e")  # the update on them makes version 2
    _finish(led, "f", 4.0, version=1)
    _finish(led, "d", 4.0)  # admitted under version 0
    assert led.groups_needed() == 0 and led.groups_needed_at_take() == 1
    outcome = led.updated(5.0, 2)
    assert outcome.taken_back == 1 and led.groups_needed() == 1


@pytest.mark.parametrize("mode", list(PastBound))
def test_an_update_applies_the_past_bound_rule(mode: PastBound) -> None:
    led = _ledger(past_bound=mode, max_staleness_versions=0, batch_trajectories=2)
    led.admit(("a",), 0.0)
    led.admit(("b",), 0.0)
    _finish(led, "a", 1.0)
    led.sent("b")
    led.generated("b", 7, 0)
    assert led.capacity() == 0
    led.updated(3.0, 1)  # no batch was taken: both are past a bound of 0
    states = {t: led.state_of(t) for t in ("a", "b")}
    if mode is PastBound.DROP:
        assert states == {"a": TrajState.DROPPED, "b": TrajState.DROPPED}
        assert led.totals.wasted_tokens == 17
    elif mode is PastBound.RESTART:
        assert states == {"a": TrajState.QUEUED, "b": TrajState.QUEUED}
        assert led.totals.wasted_tokens == 17
    else:  # interrupt: b goes on with its 7 tokens; a, finished, starts again
        assert states == {"a": TrajState.QUEUED, "b": TrajState.GENERATING}
        assert led.trajectories["b"].spans == [(0, 7)]
        assert led.trajectories["b"].head_version == 1
        assert led.totals.wasted_tokens == 10
    led.check()
    assert all(r.state in RUNNING or r.state is TrajState.DROPPED for r in led.unconsumed())


@pytest.mark.parametrize(("mode", "staleness"), [(PastBound.RESTART, 1), (PastBound.INTERRUPT, 0)])
def test_off_policy_tokens_are_those_of_older_weights(mode: PastBound, staleness: int) -> None:
    # restart: its head is the version it was admitted under; interrupt: the newest
    # weights that generated its tokens (it went on under them)
    led = _ledger(batch_trajectories=1, past_bound=mode)
    led.admit(("a",), 0.0)
    led.sent("a")
    led.generated("a", 5, 0)
    assert led.updated(1.0, 1).empty  # staleness 1 is within the bound
    led.generated("a", 3, 1)
    led.turn_ended("a", 2.0, last=True)
    batch = led.take_batch(2.0)
    assert (batch.tokens, batch.off_policy_tokens) == (8, 5)
    assert batch.max_staleness_versions == staleness


def test_rules_reject_a_batch_of_partial_groups() -> None:
    with pytest.raises(ValueError, match="not a multiple of group_size 3"):
        RolloutRules(batch_trajectories=4, max_staleness_versions=1, group_size=3)
