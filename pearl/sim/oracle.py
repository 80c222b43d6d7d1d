"""An upper bound on the trajectories any policy can finish on the same inputs.

Every policy sees the same seeded trajectory stream (trajectory ``j`` is the same in
every run of a seed), the same GPUs and the same rollout rules (``pearl.rollout.rules``).
The oracle bounds the number of trajectories finished by the end of the run ``T``, with
one argument per batching. Both leave out costs every run pays (transitions, queueing, KV
limits, contention), so the oracle is loose by those. The first-completed one is tight
for its relaxation: the rollout ledger replayed with every trajectory at its own time
from its admission (``pearl.sim.oracle_replay``) reaches it on the shipped scenarios, so
its slack is what the GPUs cost a trajectory beyond the best engine alone
(``docs/baselines.md``). ``tests/sim/test_oracle.py``, ``test_oracle_soundness.py`` and
``test_oracle_replay.py`` check that no simulated policy, and no such replay, exceeds it.

**In order** (``batching: in-order``; today's bound, unchanged bit for bit). Two bounds;
the oracle is the smaller:

1. **Critical path.** Trajectory ``j`` cannot finish before its batch may start plus its
   own shortest possible time: every tool latency (exact), every turn's prefill at the
   fastest engine of the profile with nothing else batched (``a + b n``, attention
   ignored) and every output token at the fastest decode step of any batch size with
   no context. Batches ``0..k`` start no earlier than the cheapest way to
   have an engine (a cold start, or the trainer's offload and a wake); batch ``b > k``
   starts no earlier than batch ``b - k - 1``'s bound plus one training step, since the
   update that consumes it must finish first. Every term is a lower bound of what any
   policy's run takes, so the count of ``j`` whose bound is at most ``T`` bounds the count
   finished.
2. **Capacity.** The trajectories finished need at least their work in GPU-seconds:
   prompt and observation tokens at the smallest prefill cost per token of any engine
   (``tp x b``) and output tokens at the smallest decode cost per token of any engine and
   batch size (``tp x step_s(B, 0) / B``). No policy has more GPU-seconds than every base
   GPU (the trainer's included, as if it never trained) and every elastic window's GPUs
   for the whole run; the bound counts the cheapest trajectories that fit.

**First completed** (``batching: first-completed``; every ``past_bound`` mode, group size
``g``, ``max_in_flight``). Batch ``b`` no longer waits for batch ``b - k - 1``'s slowest
trajectory, so step 1 above is not a bound here. The count bounded is of the trajectories
*accepted* at ``T`` (finished and not dropped; a restarted one counts once, by its last
finish). ``B`` trajectories a batch, ``G = B / g`` groups, staleness ``η``, ``u`` updates
done, ``F`` the first engine (as in step 1), ``E_i`` a lower bound of update ``i``'s end
in every run (``E_0 = 0``).

- F1. **Own time and work** (``pearl.sim.oracle_costs``): per trajectory, a lower bound of
  its time from admission (or a restart) to its finish, counting each turn's context
  (prefill attention, decode at the context each token is generated at), and of its
  GPU-seconds. A restarted trajectory's fresh sample is drawn apart from the stream; the
  oracle only knows that it is at least the smallest trajectory (one prompt and one
  output token). Under ``interrupt`` only a *finished* trajectory past the bound is
  started again (a running one goes on with its partial output): it has run its own
  sample to the end first, so its own time, work and finish bound stand, and so do its
  group's (a group is complete only when its last member's last run has finished).
- F2. **Admission.** Admitted = running + accepted + dropped, and admission keeps
  ``running + accepted <= (η + u + 1) B``: nothing else raises that sum (a finish moves a
  trajectory from running to accepted, a restart back). So while ``u`` updates are done
  at most ``A(u) = (η + u + 1) B + D(u)`` slots of the stream were admitted, ``D(u)``
  those dropped by then (``oracle_async.max_admitted``). Only ``drop`` drops: under
  ``interrupt`` and ``restart``, ``D(u) = 0``. Under ``drop`` a group dropped at update
  ``x``'s end was admitted while at most ``x - η - 1`` updates were done (its head
  version is at least its admission's and past the bound) and was never consumed, while
  updates ``1..x - η`` consumed ``(x - η) B`` such slots: so
  ``D(x) <= A(x - η - 1) - (x - η) B <= η B + D(x - η - 1)``, i.e.
  ``D(u) <= η B floor(u / (η + 1))``. Slot ``j`` is admitted in stream order, so no
  earlier than the end of update ``p(j) = min{u : A(u) > j}``. (Before, ``interrupt``
  was counted as ``drop``: it let ``η B`` more slots in every ``η + 1`` updates, a pool
  of fast groups no run has, and made the bound twice as loose on the shipped
  scenarios; ``docs/baselines.md``.)
- F3. **Finish.** Slot ``j`` finishes no earlier than ``max(F, E_p(j)) + own_j``; under
  ``restart``, one restarted at update ``x``'s end (``x >= p(j) + η + 1``: its head
  version is past the bound) may instead finish at ``E_x`` plus the smallest own time.
- F4. **Updates.** Update ``i`` starts after update ``i - 1`` ends and once ``i G``
  complete groups have finished (each batch is ``G`` complete groups, each consumed
  once), among the slots admitted by then (``p <= i - 1``): no earlier than the
  ``i G``-th smallest group finish bound (a group's is its members' largest). Their work
  needs that many GPU-seconds by then: every base GPU and window GPU from ``F`` after it
  opens, less the trainer's GPUs during the ``i - 1`` updates done (an update holds all of
  them). Their own times need ``M`` trajectories in flight for that long (F6), and their
  blended costs the blended budget (F8). So ``E_i`` = the latest of these plus one
  training step, and no run ends more than ``u_max = max{i : E_i <= T}`` updates by
  ``T``.
- F5. **Accepted.** At ``T``, ``accepted <= (η + u + 1) B``.
- F6. **In flight.** At every instant ``running <= (η + 1) B`` (accepted ``>=`` consumed
  ``>= u B``). A run started by admission (a trajectory's first) needs ``running + g <=
  max_in_flight`` when it starts, so first runs never exceed ``max_in_flight``; only a
  restart starts a run unadmitted (and may take ``running`` past the cap). Call the
  smaller cap ``M``. Each accepted trajectory ran for at least its own time in its first
  run, or (restarted under ``restart``) at least the smallest trajectory's in its last,
  which ``M = max_in_flight`` does not cap, so it counts 0 there; so their own times sum
  to at most ``M t`` by ``t``.
- F7. **The count.** A run with ``u <= u_max`` updates by ``T`` has accepted only slots
  with ``p <= u`` whose finish bound (F3, restarts at updates ``<= u``) is at most ``T``
  (critical path), at most ``(η + u + 1) B`` of them (F5), whose works fit in the
  GPU-seconds by ``T`` less ``u`` training steps on the trainer's GPUs (capacity: the
  cheapest count), whose own times fit in ``M T`` (in flight) and whose blended costs
  fit in the blended budget (F8). The oracle is the largest, over ``u = 0..u_max``, of the
  smallest of these counts.
- F8. **GPU-seconds and time in flight together.** A decode step of ``n`` sequences,
  ``m`` of them accepted ones, costs ``tp (base + per_seq n + per_ctx K)`` GPU-seconds and
  keeps each of the ``m`` in flight that long; so each accepted token at context ``C``
  takes a GPU share of at least ``tp (base / m + per_seq + per_ctx C)`` and adds at least
  ``base + m (per_seq + per_ctx C)`` to the sum of its step's accepted seconds in flight
  (``pearl.sim.oracle_costs``; prefill and tools likewise). For any price ``μ > 0`` of a
  second in flight (in GPUs), the accepted trajectories' GPU-seconds plus ``μ`` times
  their seconds in flight fit in the GPU-seconds plus ``μ M t``; each token's blended
  cost is at least its least over ``m`` (a token cannot be both at batch-1 speed and at
  a full batch's GPU cost). Every price gives a bound; the oracle tries 13, a factor 2
  apart around base GPUs per ``M``. (A restart's last run counts only its GPU-seconds
  where ``M = max_in_flight``, as in F6.)

An in-order run obeys F1-F8 too (its batches are complete groups; admission is the same
rule), but ``batching: in-order`` keeps the bound above so that old results reproduce.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pearl.core.profile import EngineProfile, RuntimeProfile
from pearl.rollout.rules import Batching
from pearl.sim.availability import Window
from pearl.sim.oracle_async import GpuSupply, first_completed_bound
from pearl.sim.runner import RunInputs
from pearl.sim.scenario import Scenario
from pearl.sim.trajectories import TrajectorySpec


@dataclass(frozen=True)
class OracleBound:
    """The bound and its parts. In order: ``trajectories`` is the smaller of the two
    ``by_`` counts and the rest is None. First completed: the four ``by_`` counts at the
    ``updates`` that give the largest bound (F7), ``trajectories`` their smallest, and
    ``capacity_gpu_s`` the GPU-seconds there (by ``T``, less ``updates`` training steps)."""

    trajectories: int
    by_critical_path: int
    by_capacity: int
    capacity_gpu_s: float
    by_admission: int | None = None
    by_in_flight: int | None = None
    by_blend: int | None = None
    updates: int | None = None
    max_updates: int | None = None

    def throughput_traj_per_h(self, duration_s: float) -> float:
        return self.trajectories / (duration_s / 3600.0)


def run_engines(
    scenario: Scenario, profile: RuntimeProfile, windows: tuple[Window, ...]
) -> list[EngineProfile]:
    """Every engine of every GPU type the run can hold (trainer, rollout, elastic)."""
    c = scenario.cluster
    types = {c.trainer.gpu_type, c.rollout.gpu_type} | {w.gpu_type for w in windows}
    return [e for t in sorted(types) if t in profile.gpus for e in profile.gpus[t].engines]


def first_engine_s(profile: RuntimeProfile) -> float:
    """The soonest any GPU serves: a cold start, or the trainer's offload and a wake."""
    costs = profile.costs
    return min(costs.engine_cold_start_s, costs.trainer_offload_s + costs.wake_s)


def train_step_s(scenario: Scenario, profile: RuntimeProfile) -> float:
    step_s = scenario.training.train_step_s
    return step_s if step_s is not None else profile.costs.train_step_s


def run_oracle_bound(inputs: RunInputs) -> OracleBound:
    """The bound on the run of ``inputs``, on the very stream that run draws (its seed's
    generator, each group's samples sharing their prompt)."""
    return oracle_bound(inputs.scenario, inputs.profile, inputs.windows, inputs.stream())


def oracle_bound(
    scenario: Scenario,
    profile: RuntimeProfile,
    windows: tuple[Window, ...],
    stream: Iterable[TrajectorySpec],
) -> OracleBound:
    """``stream``: the run's trajectories in order (read only as far as any run can start);
    the argument of the scenario's ``rollout.batching`` (module docstring)."""
    if scenario.rollout.batching is Batching.IN_ORDER:
        return _in_order_bound(scenario, profile, windows, stream)
    c = scenario.cluster
    first_s = first_engine_s(profile)
    b = first_completed_bound(
        scenario.rollout.rules(),
        duration_s=scenario.duration_s,
        train_s=train_step_s(scenario, profile),
        first_engine_s=first_s,
        trainer_gpus=c.trainer.gpus,
        supply=GpuSupply(scenario.base_gpus, windows, first_s),
        engines=run_engines(scenario, profile, windows),
        stream=stream,
    )
    return OracleBound(
        trajectories=b.trajectories,
        by_critical_path=b.by_critical_path,
        by_capacity=b.by_capacity,
        capacity_gpu_s=b.capacity_gpu_s,
        by_admission=b.by_admission,
        by_in_flight=b.by_in_flight,
        by_blend=b.by_blend,
        updates=b.updates,
        max_updates=b.max_updates,
    )


def _in_order_bound(
    scenario: Scenario,
    profile: RuntimeProfile,
    windows: tuple[Window, ...],
    stream: Iterable[TrajectorySpec],
) -> OracleBound:
    """Steps 1 and 2 of the module docstring."""
    T = scenario.duration_s
    engines = run_engines(scenario, profile, windows)
    batch_sizes = np.arange(1, max(e.max_num_seqs for e in engines) + 1)
    # The fastest step of any batch size (a profile need not make it batch 1's).
    decode_token_s = min(
        float(np.min(e.decode.step_s(batch_sizes[: e.max_num_seqs], 0))) for e in engines
    )
    decode_gpu_s = min(
        float(
            np.min(
                e.tp
                * e.decode.step_s(batch_sizes[: e.max_num_seqs], 0)
                / batch_sizes[: e.max_num_seqs]
            )
        )
        for e in engines
    )
    prefill_gpu_s = min(e.tp * e.prefill.b_s_per_token for e in engines)
    first_s = first_engine_s(profile)
    train_s = train_step_s(scenario, profile)
    B, k = scenario.rollout.batch_trajectories, scenario.rollout.staleness_versions

    def own_s(spec: TrajectorySpec) -> float:
        new = [spec.prompt_tokens, *spec.new_tokens[1:]]
        prefill = sum(
            min(e.prefill.a_s + e.prefill.b_s_per_token * n for e in engines) for n in new
        )
        return prefill + sum(spec.output_tokens) * decode_token_s + sum(spec.tool_latency_s)

    batch_start: list[float] = []
    batch_end: list[float] = []
    finish_bounds: list[float] = []
    specs: list[TrajectorySpec] = []
    for j, spec in enumerate(stream):
        b = j // B
        if b == len(batch_start):
            start = first_s if b <= k else batch_end[b - k - 1] + train_s
            if start > T:
                break
            batch_start.append(start)
            batch_end.append(start)
        specs.append(spec)
        done = batch_start[b] + own_s(spec)
        batch_end[b] = max(batch_end[b], done)
        finish_bounds.append(done)
    by_path = int(sum(1 for f in finish_bounds if f <= T))
    gpu_s = scenario.base_gpus * T + sum(
        w.num_gpus * (min(w.end_s, T) - max(w.start_s, 0.0)) for w in windows if w.start_s < T
    )
    work = np.sort(
        [
            prefill_gpu_s * (s.prompt_tokens + sum(s.new_tokens))
            + decode_gpu_s * sum(s.output_tokens)
            for s in specs
        ]
    )
    by_capacity = int(np.searchsorted(np.cumsum(work), gpu_s, side="right"))
    return OracleBound(min(by_path, by_capacity), by_path, by_capacity, gpu_s)
