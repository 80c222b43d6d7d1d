"""The fluid engine model: the step model's closed forms, one call per change of the batch,
the PD roles, and runs whose throughput is the step model's within 2% on the shipped
scenarios (conservation under any calls: ``test_engine_invariants.py``, for both models)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_fixtures import CAPACITY_TOKENS, engine_profile, run_to_end

from pearl.core.roles import Role
from pearl.io.scenarios import load_scenario_and_profile
from pearl.io.simulation import run_inputs
from pearl.serving.requests import Request
from pearl.sim.baselines import make_policy
from pearl.sim.engine import EngineModel
from pearl.sim.fluid_engine import FluidEngineModel
from pearl.sim.kv_cache import BLOCK_TOKENS
from pearl.sim.runner import simulate

SCENARIOS = Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios"


def fluid(
    role: Role = Role.COLOCATED, capacity_tokens: int = CAPACITY_TOKENS, **kwargs: int
) -> FluidEngineModel:
    return FluidEngineModel(role, engine_profile(**kwargs), capacity_tokens)


def test_one_request_alone_takes_what_the_step_model_takes_in_one_call() -> None:
    engine = fluid()
    engine.submit(Request("r", "t", context_tokens=1000, output_tokens=50))
    results = run_to_end(engine, 4096)
    step = EngineModel(Role.COLOCATED, engine_profile(), CAPACITY_TOKENS)
    step.submit(Request("r", "t", context_tokens=1000, output_tokens=50))
    expected_s = sum(r.duration_s for r in run_to_end(step, 4096))
    assert len(results) == 1 and results[0].num_steps == 51
    assert results[0].duration_s == pytest.approx(expected_s, rel=1e-12)
    assert [f.request.request_id for f in results[0].finished] == ["r"]
    assert results[0].finished[0].finish_offset_s == results[0].duration_s
    assert engine.step().duration_s == 0.0 and engine.num_requests == 0


def test_a_run_ends_when_a_request_finishes_and_a_prompt_joins_at_the_next_step() -> None:
    p = engine_profile()
    engine = fluid()
    engine.submit(Request("a", "ta", context_tokens=500, output_tokens=100))
    engine.submit(Request("b", "tb", context_tokens=300, output_tokens=20))
    first = engine.step(4096)
    # one step prefills both (800 tokens of budget), then both decode: b ends after 20
    prefill_s = (
        p.prefill.a_s + p.prefill.b_s_per_token * 800 + p.prefill.c_s_per_token2 * (500**2 + 300**2)
    )
    decode_s = sum(float(p.decode.step_s(2, 800 + 2 * k)) for k in range(20))
    assert first.num_steps == 21 and [f.request.request_id for f in first.finished] == ["b"]
    assert first.duration_s == pytest.approx(prefill_s + decode_s, rel=1e-12)
    assert engine.num_generated("a") == 20 and engine.num_decoding == 1
    rest = engine.step(4096)
    assert rest.num_steps == 80 and [f.request.request_id for f in rest.finished] == ["a"]


def test_a_bounded_run_ends_at_the_first_step_boundary_at_or_after_the_bound() -> None:
    p = engine_profile()
    engine = fluid()
    engine.submit(Request("r", "t", context_tokens=100, output_tokens=1000))
    engine.step(1)  # the prefill step
    ends_s = [sum(float(p.decode.step_s(1, 100 + k)) for k in range(n)) for n in range(1, 30)]
    for bound_s in (0.0, ends_s[4], (ends_s[9] + ends_s[10]) / 2):
        engine_n = fluid()
        engine_n.submit(Request("r", "t", context_tokens=100, output_tokens=1000))
        engine_n.step(1)
        result = engine_n.step(4096, bound_s)
        n = next(i + 1 for i, end_s in enumerate(ends_s) if end_s >= bound_s)
        assert result.num_steps == n
        assert result.duration_s == pytest.approx(ends_s[n - 1], rel=1e-12)


def test_a_cached_prefix_is_reused_and_a_long_prompt_is_chunked() -> None:
    engine = fluid(max_batched_tokens=512)
    engine.submit(Request("t-0", "t", context_tokens=1300, output_tokens=3))
    first = run_to_end(engine, 4096)
    assert [r.num_prefill_tokens for r in first] == [1300]  # three chunk steps in one call
    assert first[0].num_steps == 3 + 3  # three chunk steps, then one per output token
    engine.submit(Request("t-1", "t", context_tokens=1400, output_tokens=3))
    assert engine.queued_prefill()[0] == 1400 - (1303 // BLOCK_TOKENS) * BLOCK_TOKENS
    second = run_to_end(engine, 4096)
    assert second[0].num_prefill_tokens == 1400 - (1303 // BLOCK_TOKENS) * BLOCK_TOKENS


def test_prefill_instances_hand_off_and_decode_instances_skip_the_prefill() -> None:
    pre = fluid(Role.PREFILL)
    pre.submit(Request("r", "t", context_tokens=1000, output_tokens=50))
    pre.submit(Request("s", "u", context_tokens=9000, output_tokens=50))
    results = run_to_end(pre, 4096)
    handed = [(h.request.request_id, h.kv_tokens) for r in results for h in r.handoffs]
    assert handed == [("r", 1000), ("s", 9000)] and not any(r.finished for r in results)
    dec = fluid(Role.DECODE)
    dec.submit(Request("r.d", "t", context_tokens=1000, output_tokens=50, kv_ready_tokens=1000))
    (only,) = run_to_end(dec, 4096)
    assert only.num_prefill_tokens == 0 and only.num_steps == 50


def test_abort_drain_and_abort_all_return_the_partial_outputs() -> None:
    engine = fluid(max_num_seqs=1)
    for i in range(3):
        engine.submit(Request(f"r{i}", f"t{i}", context_tokens=400, output_tokens=50))
    engine.step(4096, 0.1)
    generated = engine.num_generated("r0")
    assert 0 < generated < 50 and engine.generated_by_request()[0] == (
        engine._by_id["r0"].request,
        generated,
    )
    partial = engine.abort("r2")
    assert partial is not None and partial.num_generated_tokens == 0
    drained = engine.drain()
    assert [p.request.request_id for p in drained] == ["r1"]
    (taken,) = engine.abort_all()
    assert (taken.request.request_id, taken.num_generated_tokens) == ("r0", generated)
    assert engine.num_requests == 0 and engine.kv.num_held_blocks == 0


def _throughput(scenario: str, policy: str, model: str) -> float:
    sc, profile = load_scenario_and_profile(SCENARIOS / f"{scenario}.yaml")
    sc = sc.model_copy(update={"duration_s": 600.0, "engine_model": model})
    m = simulate(
        run_inputs(sc, profile, 0), make_policy(policy, sc.policy, sc.cluster.trainer.nodes)
    )
    return m.trajectories / m.hours


@pytest.mark.parametrize(
    ("scenario", "policy"),
    [
        pytest.param("qwen3-8b", "roll-fixed", id="8b-roll-fixed"),
        pytest.param("qwen3-8b", "pearl", id="8b-pearl"),
        pytest.param("qwen3-30b-a3b", "roll-fixed", id="30b-roll-fixed"),
    ],
)
def test_short_runs_keep_the_step_models_throughput_within_two_percent(
    scenario: str, policy: str
) -> None:
    """600 s of a shipped scenario, seed 0 (``benchmarks/fluid_check.py`` runs them all)."""
    step = _throughput(scenario, policy, "step")
    assert _throughput(scenario, policy, "fluid") == pytest.approx(step, rel=0.02)
