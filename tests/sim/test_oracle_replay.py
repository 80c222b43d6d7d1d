"""The oracle's pieces under hypothesis, and its relaxation replayed.

- F2 against the real ledger: in random runs of ``tests/rollout``'s ledger world, the
  trajectories admitted never exceed ``max_admitted`` at the updates done.
- The replay (``pearl.sim.oracle_replay``) is a run the oracle's argument covers: on the
  toy engine of ``oracle_fixtures`` (a decode step of 0.01 s for up to 4 sequences), with
  at most 32 trajectories running (4 on each of the 8 GPUs left while the trainer holds
  its 8), every trajectory can run at its own time from its admission, so the bound is at
  least the replay's count and updates, for random streams (tools, several turns),
  every batching and past-bound mode, groups, staleness, a cap in flight and any restart
  samples.
- By hand: the replay of ``test_oracle``'s stream reaches the bound.
"""

from __future__ import annotations

import oracle_fixtures as O
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant
from rollout.test_ledger import LedgerRun

from pearl.rollout.rules import Batching, PastBound
from pearl.sim.oracle import oracle_bound
from pearl.sim.oracle_async import max_admitted
from pearl.sim.oracle_costs import CostModel
from pearl.sim.oracle_replay import replay
from pearl.sim.trajectories import TrajectorySpec

# --- F2 on the ledger ---------------------------------------------------------------------


class AdmissionRun(LedgerRun):
    @invariant()
    def admitted_within_max_admitted(self) -> None:
        led = self.ledger
        assert led.totals.admitted <= max_admitted(led.rules, self.updates_done)


TestAdmissionRun = AdmissionRun.TestCase
TestAdmissionRun.settings = settings(
    max_examples=200,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# --- the replay never beats the bound -----------------------------------------------------

MAX_RUNNING = 32  # 8 toy GPUs x 4 sequences: every one at its own time, even in training


def _spec(outputs: list[int], tools_s: list[float]) -> TrajectorySpec:
    """One prompt token; turns of these outputs; tool latencies between them."""
    n = len(outputs)
    return TrajectorySpec(1, (0,) * n, tuple(outputs), tuple(tools_s[: n - 1]))


specs_st = st.lists(
    st.builds(
        _spec,
        st.lists(st.integers(1, 300), min_size=1, max_size=3),
        st.lists(st.one_of(st.floats(0.0, 1.0), st.floats(0.0, 20.0)), min_size=2, max_size=2),
    ),
    min_size=8,
    max_size=160,
)


@st.composite
def rules_st(draw: st.DrawFn) -> dict[str, object]:
    g = draw(st.sampled_from([1, 2, 4]))
    groups = draw(st.integers(1, 4))
    staleness = draw(st.integers(0, 2))
    batch = g * groups
    if (staleness + 1) * batch > MAX_RUNNING:
        batch, groups = g, 1
        staleness = min(staleness, MAX_RUNNING // g - 1)
    cap = draw(st.one_of(st.none(), st.integers(g, 3 * g)))
    return {
        "batch": batch,
        "staleness": staleness,
        "group_size": g,
        "max_in_flight": cap,
        "batching": draw(st.sampled_from(list(Batching))),
        "past_bound": draw(st.sampled_from(list(PastBound))),
        "train_step_s": draw(st.sampled_from([0.5, 3.0, 10.0])),
        "duration_s": draw(st.floats(3.0, 80.0)),
    }


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs_st, rules=rules_st(), restart_own_s=st.floats(0.0, 5.0))
def test_the_replay_never_beats_the_bound(
    specs: list[TrajectorySpec], rules: dict[str, object], restart_own_s: float
) -> None:
    sc = O.toy_scenario(**rules)  # type: ignore[arg-type]
    prof = O.toy_profile()
    bound = oracle_bound(sc, prof, (), specs)
    model = CostModel(prof.gpus["toy"].engines)
    own = [float(t) for t in model.costs(specs).own_s]
    smallest = float(model.costs([TrajectorySpec(1, (0,), (1,), ())]).own_s[0])
    r = replay(
        sc.rollout.rules(),
        duration_s=sc.duration_s,
        train_s=float(rules["train_step_s"]),  # type: ignore[arg-type]
        first_engine_s=O.FIRST_ENGINE_S,
        own_s=own.__getitem__,
        restart_s=lambda _: smallest + restart_own_s,
        num_slots=len(own),
    )
    assert r.trajectories <= bound.trajectories
    if bound.max_updates is not None:  # first completed
        assert r.updates <= bound.max_updates
    event(f"{min(r.updates, 3)}+ updates")
    event("the replay reaches the bound" if r.trajectories == bound.trajectories else "below")


def test_the_replay_reaches_the_bound_by_hand() -> None:
    # test_oracle's SLOW_TWO: B = 2, η = 1, train 10 s, F = 2 s; slots 0 and 3 take 10 s,
    # the rest 1 s. The bound (3 updates, 10 accepted by 40 s) is a run: the replay's
    # updates end at 13, 23 and 33 s as the hand computation of test_oracle says.
    owns = [10.0, 1.0, 1.0, 10.0] + [1.0] * 16
    sc = O.toy_scenario(duration_s=40.0, batch=2, staleness=1)
    bound = oracle_bound(sc, O.toy_profile(), (), [O.spec(s) for s in owns])
    r = replay(
        sc.rollout.rules(),
        duration_s=40.0,
        train_s=10.0,
        first_engine_s=O.FIRST_ENGINE_S,
        own_s=owns.__getitem__,
        restart_s=lambda _: 0.01,
        num_slots=len(owns),
    )
    assert r.update_ends_s == (13.0, 23.0, 33.0)
    assert (r.trajectories, r.updates) == (bound.trajectories, bound.max_updates) == (10, 3)
