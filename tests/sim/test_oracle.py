"""The oracle bound: no simulated policy beats it, it grows with the run, and its
critical-path bound matches a hand computation."""

from __future__ import annotations

import itertools

import pytest
import sim_fixtures as F

from pearl.sim.baselines import RUN_POLICIES
from pearl.sim.oracle import OracleBound, oracle_bound
from pearl.sim.rollout import trajectory_stream
from pearl.sim.runner import RunInputs, trajectory_rng


def _oracle(inputs: RunInputs) -> OracleBound:
    sc = inputs.scenario
    stream = trajectory_stream(
        inputs.trajectory_model, trajectory_rng(inputs.seed), sc.rollout.max_context_tokens
    )
    return oracle_bound(sc, inputs.profile, inputs.windows, stream)


@pytest.mark.parametrize("policy", RUN_POLICIES)
def test_no_policy_beats_the_oracle_on_busy_inputs(policy: str) -> None:
    r = F.busy_run(policy)
    bound = _oracle(r.sim.inputs)
    assert 0 < r.metrics.trajectories <= bound.trajectories
    assert bound.trajectories == min(bound.by_critical_path, bound.by_capacity)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("policy", RUN_POLICIES)
def test_no_policy_beats_the_oracle_on_light_inputs(policy: str, seed: int) -> None:
    # Light work, short train steps: the run is close to its critical path.
    sc = F.scenario(elastic=True, duration_s=600.0, batch=16, train_step_s=5.0)
    inputs = F.inputs(sc, windows=F.PREEMPTED_WINDOWS, seed=seed)
    m = F.run(inputs, policy).metrics
    assert 0 < m.trajectories <= _oracle(inputs).trajectories


def test_the_oracle_is_monotone_in_duration() -> None:
    bounds = []
    for duration_s in (200.0, 400.0, 900.0, 1800.0, 3600.0):
        sc = F.scenario(elastic=True, duration_s=duration_s, batch=32, train_step_s=10.0)
        bounds.append(_oracle(F.inputs(sc, model=F.busy_model(), windows=F.PREEMPTED_WINDOWS)))
    for a, b in itertools.pairwise(bounds):
        assert a.trajectories <= b.trajectories
        assert a.by_critical_path <= b.by_critical_path
        assert a.by_capacity <= b.by_capacity
        assert a.capacity_gpu_s < b.capacity_gpu_s
    assert bounds[0].trajectories < bounds[-1].trajectories


def test_capacity_counts_every_base_gpu_and_the_windows_inside_the_run() -> None:
    sc = F.scenario(elastic=True, duration_s=500.0)
    bound = _oracle(F.inputs(sc, windows=F.PREEMPTED_WINDOWS))
    # 16 base GPUs for 500 s; 16 GPUs over [0, 420); 8 GPUs over [100, 500) (clipped)
    assert bound.capacity_gpu_s == pytest.approx(16 * 500 + 16 * 420 + 8 * 400)


def test_critical_path_by_hand() -> None:
    # B = 1, k = 0: trajectory j is batch j, which starts once update j - 1 has finished.
    # Every trajectory: one turn, 100 prompt tokens, 10 output tokens, no tool.
    sc = F.scenario(batch=1, staleness=0, duration_s=100.0, train_step_s=20.0)
    inputs = F.inputs(sc, model=F.constant_model(turns=1, prompt=100, output=10))
    prof = F.profile()
    c = prof.costs
    assert (c.engine_cold_start_s, c.trainer_offload_s, c.wake_s) == (38.2, 0.819, 0.82)
    # The first engine: the cheaper of a cold start and the trainer's offload + a wake.
    first_s = 0.819 + 0.82
    # Fastest prefill of 100 tokens, a + b n (h800 tp 4): 0.003339 + 1.239e-05 x 100.
    # Fastest decode step of one sequence with no context, step_s(1, 0) (h20 tp 4 small
    # regime base): 0.003056 s per output token.
    assert prof.engine("h800", 4).prefill.a_s == 0.003339
    assert prof.engine("h20", 4).decode.small.base_s == 0.003056
    own_s = 0.003339 + 1.239e-05 * 100 + 10 * 0.003056
    # Trajectory j finishes no earlier than first + (j + 1) own + 20 j:
    # j = 4: 1.639 + 5 x 0.035138 + 80 = 81.81 s <= 100; j = 5: 101.85 s > 100.
    assert first_s + 5 * own_s + 80 < 100.0 < first_s + 6 * own_s + 100
    bound = _oracle(inputs)
    assert bound.by_critical_path == 5
    # 16 GPUs x 100 s hold far more such trajectories, but the bound reads the stream only
    # as far as a batch can start (j = 5's batch starts at 101.8 s): five
    assert bound.by_capacity == 5
    assert bound.trajectories == 5
    # and the simulator, paying a real cold start, finishes fewer
    assert F.run(inputs, "roll-fixed").metrics.trajectories <= 5


def test_capacity_by_hand() -> None:
    # Two whole batches start at once (B = 1024, k = 1) and each trajectory is long:
    # GPU-seconds bind. Each needs prefill_gpu_s x prompt + decode_gpu_s x output at the
    # cheapest engine (per token: tp x b for prefill; tp x step_s(B, 0) / B for decode).
    sc = F.scenario(batch=1024, staleness=1, duration_s=100.0)
    inputs = F.inputs(sc, model=F.constant_model(turns=1, prompt=30000, output=2000))
    prof = F.profile()
    engines = [e for g in ("h800", "h20") for e in prof.gpus[g].engines]
    prefill_gpu_s = min(e.tp * e.prefill.b_s_per_token for e in engines)
    decode_gpu_s = min(
        e.tp * float(e.decode.step_s(b, 0)) / b
        for e in engines
        for b in range(1, e.max_num_seqs + 1)
    )
    work_gpu_s = prefill_gpu_s * 30000 + decode_gpu_s * 2000
    bound = _oracle(inputs)
    assert bound.capacity_gpu_s == 16 * 100.0
    assert bound.by_capacity == int(16 * 100.0 / work_gpu_s)
    # the path bound: a batch every ~28 s (8 s of trajectory, 20 s of update), 8 batches
    assert bound.by_capacity < 2048 < bound.by_critical_path
    assert bound.trajectories == bound.by_capacity
