"""What both engine models promise, under any calls: KV pressure queues and preempts but
every request finishes, exactly once, with all its tokens; the KV cache never overflows;
the same calls give the same results."""

from __future__ import annotations

import pytest
from engine_fixtures import engine_profile, run_to_end
from hypothesis import given, settings
from hypothesis import strategies as st

from pearl.core.roles import Role
from pearl.serving.requests import Request
from pearl.sim.engine import EngineModel, EngineStepResult
from pearl.sim.fluid_engine import FluidEngineModel

MODELS = [
    pytest.param(EngineModel, id="step"),
    pytest.param(FluidEngineModel, id="fluid"),
]
Model = type[EngineModel] | type[FluidEngineModel]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("max_steps", [1, 4096])
def test_kv_pressure_queues_and_preempts_and_everything_finishes(
    model: Model, max_steps: int
) -> None:
    engine = model(Role.COLOCATED, engine_profile(), 1024)
    for i in range(6):
        engine.submit(Request(f"r{i}", f"t{i}", context_tokens=300, output_tokens=200))
    results = run_to_end(engine, max_steps)
    assert max(r.num_decode_seqs for r in results) <= 3
    assert sum(len(r.preempted) for r in results) > 0
    finished = sorted(f.request.request_id for r in results for f in r.finished)
    assert finished == [f"r{i}" for i in range(6)]
    assert sum(r.num_generated_tokens for r in results) == 6 * 200


requests_strategy = st.lists(
    st.tuples(st.integers(1, 600), st.integers(1, 300)), min_size=1, max_size=12
)


@pytest.mark.parametrize("model", MODELS)
@settings(max_examples=80, deadline=None)
@given(
    requests=requests_strategy,
    capacity_tokens=st.sampled_from([1024, 2048, 8192]),
    max_num_seqs=st.integers(1, 8),
    max_batched_tokens=st.sampled_from([64, 512, 8192]),
    max_steps=st.sampled_from([1, 5, 1000, 4096]),
    bound_s=st.sampled_from([0.0, 0.05, float("inf")]),
    shared_prefixes=st.booleans(),
)
def test_every_request_finishes_once_and_kv_never_overflows(
    model: Model,
    requests: list[tuple[int, int]],
    capacity_tokens: int,
    max_num_seqs: int,
    max_batched_tokens: int,
    max_steps: int,
    bound_s: float,
    shared_prefixes: bool,
) -> None:
    def run() -> tuple[list[EngineStepResult], EngineModel | FluidEngineModel]:
        profile = engine_profile(max_batched_tokens, max_num_seqs)
        engine = model(Role.COLOCATED, profile, capacity_tokens)
        for i, (prompt, output) in enumerate(requests):
            traj_id = f"t{i % 3}" if shared_prefixes else f"t{i % 3}.{i}"
            engine.submit(Request(f"r{i}", traj_id, prompt, output))
        # asserts the counts, the duration and the KV bound at every call
        return run_to_end(engine, max_steps, bound_s), engine

    results, engine = run()
    finished = sorted(f.request.request_id for r in results for f in r.finished)
    assert finished == sorted(f"r{i}" for i in range(len(requests)))
    assert sum(r.num_generated_tokens for r in results) == sum(o for _, o in requests)
    assert engine.num_requests == 0 and engine.kv.num_held_blocks == 0
    assert run()[0] == results  # same inputs, same outputs
