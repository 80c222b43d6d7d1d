"""The step-level engine model: closed forms, batching, prefix reuse, KV control, PD."""

from __future__ import annotations

import math

import numpy as np
import pytest
from engine_fixtures import CAPACITY_TOKENS, engine_profile, run_to_end
from testing_profiles import make_profile

from pearl.core.profile import RuntimeProfile
from pearl.core.roles import Role
from pearl.serving.requests import Request
from pearl.sim.engine import EngineModel, kv_transfer_s
from pearl.sim.kv_cache import BLOCK_TOKENS


def runtime_profile() -> RuntimeProfile:
    """The shared test profile; its h100 tp 1 engine has ``engine_profile()``'s coefficients."""
    profile = make_profile(kv_capacity_tokens=CAPACITY_TOKENS)
    assert profile.engine("h100", 1) == engine_profile()
    return profile


def make_engine(
    role: Role = Role.COLOCATED, capacity_tokens: int = CAPACITY_TOKENS, **kwargs: int
) -> EngineModel:
    return EngineModel(role, engine_profile(**kwargs), capacity_tokens)


def decode_alone_s(ctx_tokens: int, output_tokens: int) -> float:
    decode = engine_profile().decode
    return sum(float(decode.step_s(1, ctx_tokens + k)) for k in range(output_tokens))


@pytest.mark.parametrize("max_steps", [1, 7, 10_000])
def test_one_request_alone_takes_prefill_plus_decode_steps(max_steps: int) -> None:
    engine = make_engine()
    engine.submit(Request("r", "t", context_tokens=1000, output_tokens=50))
    results = run_to_end(engine, max_steps)
    expected_s = engine_profile().prefill.batch_s(1000) + decode_alone_s(1000, 50)
    assert sum(r.duration_s for r in results) == pytest.approx(expected_s, rel=1e-12)
    assert sum(r.num_steps for r in results) == 51
    assert [f.request.request_id for r in results for f in r.finished] == ["r"]
    assert results[-1].finished[0].finish_offset_s == results[-1].duration_s
    assert engine.step() == engine.step() and engine.step().duration_s == 0.0


def test_a_request_joining_mid_decode_changes_the_step_as_the_formula_says() -> None:
    p = engine_profile()
    engine = make_engine()
    engine.submit(Request("a", "ta", context_tokens=500, output_tokens=100))
    for _ in range(11):  # prefill, then 10 tokens
        engine.step()
    assert engine.num_generated("a") == 10
    engine.submit(Request("b", "tb", context_tokens=300, output_tokens=20))
    mixed = engine.step()  # a decodes (510 in context) while b prefills
    assert mixed.duration_s == pytest.approx(
        float(p.decode.step_s(1, 510)) + p.prefill.batch_s([300], [0]), rel=1e-12
    )
    assert (mixed.num_decode_seqs, mixed.num_prefill_tokens) == (1, 300)
    both = engine.step()
    assert both.duration_s == pytest.approx(float(p.decode.step_s(2, 511 + 300)), rel=1e-12)
    assert both.num_generated_tokens == 2


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    engine = make_engine(max_batched_tokens=512)
    engine.submit(Request("r", "t", context_tokens=1300, output_tokens=3))
    results = run_to_end(engine)
    prefill = [r.num_prefill_tokens for r in results if r.num_prefill_tokens]
    assert prefill == [512, 512, 276] and len(prefill) == math.ceil(1300 / 512)
    p = engine_profile().prefill
    assert results[1].duration_s == pytest.approx(p.batch_s([512], [512]))
    assert sum(r.num_decode_seqs for r in results) == 3


def test_the_next_turn_prefills_only_new_tokens_while_its_prefix_is_cached() -> None:
    p = engine_profile().prefill
    engine = make_engine(capacity_tokens=2048)
    engine.submit(Request("t1-0", "t1", context_tokens=1000, output_tokens=100))
    run_to_end(engine, max_steps=1000)
    cached = (1100 // BLOCK_TOKENS) * BLOCK_TOKENS
    assert engine.cached_tokens("t1") == cached
    engine.submit(Request("t1-1", "t1", context_tokens=1300, output_tokens=10))
    first = engine.step()
    assert first.num_prefill_tokens == 1300 - cached
    assert first.duration_s == pytest.approx(p.batch_s([1300 - cached], [cached]))
    run_to_end(engine, max_steps=1000)
    # another trajectory needs the blocks: t1's prefix is evicted, its next turn pays in full
    engine.submit(Request("t2-0", "t2", context_tokens=1500, output_tokens=10))
    run_to_end(engine)
    assert engine.cached_tokens("t1") == 0
    engine.submit(Request("t1-2", "t1", context_tokens=1400, output_tokens=10))
    assert engine.step().num_prefill_tokens == 1400


def test_queued_prefill_is_the_prompt_work_ahead_less_the_cached_prefixes() -> None:
    engine = make_engine(max_batched_tokens=512)
    engine.submit(Request("t1-0", "t1", context_tokens=1000, output_tokens=100))
    run_to_end(engine, max_steps=1000)
    cached = engine.cached_tokens("t1")
    assert cached == 1088 and engine.queued_prefill() == (0, 0)
    engine.submit(Request("t2-0", "t2", context_tokens=1300, output_tokens=5))
    engine.submit(Request("t1-1", "t1", context_tokens=1300, output_tokens=5))
    pairs_t1 = 1300**2 - cached**2
    assert engine.queued_prefill() == (1300 + 1300 - cached, 1300**2 + pairs_t1)
    engine.step()  # t2's first chunk of 512 tokens; t1's turn still waits behind it
    assert engine.num_decoding == 0 and engine.num_requests == 2
    assert engine.queued_prefill() == (788 + 1300 - cached, 1300**2 - 512**2 + pairs_t1)
    while engine.num_decoding < 2:
        engine.step()
    assert engine.queued_prefill() == (0, 0)
    assert engine.decoding_context_tokens == 2 * 1300  # both prompts, computed in one step


def test_a_fully_cached_prompt_recomputes_its_last_token() -> None:
    engine = make_engine()
    engine.submit(Request("a", "t", context_tokens=64, output_tokens=16))
    run_to_end(engine)
    engine.submit(Request("b", "t", context_tokens=64, output_tokens=1))
    assert engine.step().num_prefill_tokens == 1


def test_prefill_then_decode_on_another_instance_adds_the_transfer() -> None:
    profile = runtime_profile()
    prefill = EngineModel.from_profile(Role.PREFILL, profile, "h100", 1)
    decode = EngineModel.from_profile(Role.DECODE, profile, "h100", 1)
    prefill.submit(Request("r", "t", context_tokens=1000, output_tokens=20))
    step = prefill.step()
    assert [h.kv_tokens for h in step.handoffs] == [1000] and not prefill.has_work
    assert prefill.cached_tokens("t") == (1000 // BLOCK_TOKENS) * BLOCK_TOKENS
    transfer_s = kv_transfer_s(1000, profile, "h100", same_node=False)
    assert transfer_s == pytest.approx(1000 * profile.model.kv_bytes_per_token / 25e9)
    decode.submit(Request("r", "t", context_tokens=1000, output_tokens=20, kv_ready_tokens=1000))
    decode_s = sum(r.duration_s for r in run_to_end(decode))
    total_s = step.handoffs[0].ready_offset_s + transfer_s + decode_s
    expected_s = engine_profile().prefill.batch_s(1000) + transfer_s + decode_alone_s(1000, 20)
    assert total_s == pytest.approx(expected_s, rel=1e-12)
    assert kv_transfer_s(1000, profile, "h100", same_node=True) < transfer_s


def test_abort_returns_the_partial_output_to_continue_elsewhere() -> None:
    engine = make_engine()
    engine.submit(Request("r", "t", context_tokens=400, output_tokens=50))
    for _ in range(11):
        engine.step()
    partial = engine.abort("r")
    assert partial is not None and partial.num_generated_tokens == 10
    assert engine.abort("r") is None and not engine.has_work
    assert engine.kv.num_held_blocks == 0
    rest = partial.continuation("r2")
    assert (rest.context_tokens, rest.output_tokens) == (410, 40)


def test_drain_hands_back_the_queue_and_abort_all_takes_the_rest() -> None:
    engine = make_engine(max_num_seqs=1)
    for i in range(3):
        engine.submit(Request(f"r{i}", "t", context_tokens=100, output_tokens=30))
    for _ in range(5):
        engine.step()
    drained = engine.drain()
    assert [p.request.request_id for p in drained] == ["r1", "r2"]
    with pytest.raises(ValueError, match="draining"):
        engine.submit(Request("r3", "t", 10, 10))
    taken = engine.abort_all()
    assert [(p.request.request_id, p.num_generated_tokens) for p in taken] == [("r0", 4)]
    assert not engine.has_work


def test_a_request_that_can_never_fit_is_refused() -> None:
    engine = make_engine(capacity_tokens=1024)
    with pytest.raises(ValueError, match="never fit"):
        engine.submit(Request("r", "t", context_tokens=1000, output_tokens=100))


def test_multi_step_calls_end_at_the_step_ends_and_track_the_output() -> None:
    decode = engine_profile().decode
    engine = make_engine()
    engine.submit(Request("r", "t", context_tokens=1000, output_tokens=300))
    engine.step()  # the prefill
    ends_s = np.cumsum(decode.step_s(1, 1000 + np.arange(300)))
    # a bound exactly at the end of the fifth step includes it, and no more
    five = engine.step(4096, float(ends_s[4]))
    assert (five.num_steps, five.duration_s, five.finished) == (5, float(ends_s[4]), ())
    assert engine.num_generated("r") == 5
    # a bound short of the first step still runs one
    one = engine.step(4096, 0.0)
    assert (one.num_steps, one.duration_s) == (1, float(decode.step_s(1, 1005)))
    assert engine.num_generated("r") == 6
    # many steps at once: the same sums as one step after another
    rest = engine.step(4096)
    later_s = np.cumsum(decode.step_s(1, 1006 + np.arange(294)))
    assert (rest.num_steps, rest.duration_s) == (294, float(later_s[-1]))
    assert [f.request.request_id for f in rest.finished] == ["r"] and not engine.has_work
    assert engine.cached_tokens("t") == (1300 // BLOCK_TOKENS) * BLOCK_TOKENS


def test_abort_after_multi_step_decodes_returns_every_token_and_frees_the_blocks() -> None:
    engine = make_engine()
    engine.submit(Request("a", "ta", context_tokens=500, output_tokens=100))
    engine.submit(Request("b", "tb", context_tokens=700, output_tokens=100))
    engine.step()
    assert engine.step(7).num_steps == 7
    assert engine.step(30).num_steps == 30
    assert (engine.num_generated("a"), engine.num_generated("b")) == (37, 37)
    blocks_b = -(-(700 + 37) // BLOCK_TOKENS)
    assert engine.kv.num_held_blocks == -(-(500 + 37) // BLOCK_TOKENS) + blocks_b
    partial = engine.abort("a")
    assert partial is not None and partial.num_generated_tokens == 37
    assert engine.kv.num_held_blocks == blocks_b
    assert engine.cached_tokens("ta") == ((500 + 37) // BLOCK_TOKENS) * BLOCK_TOKENS
    assert engine.step(20).num_steps == 20
    taken = engine.abort_all()
    assert [(p.request.request_id, p.num_generated_tokens) for p in taken] == [("b", 57)]
    assert engine.cached_tokens("tb") == ((700 + 57) // BLOCK_TOKENS) * BLOCK_TOKENS
    assert engine.kv.num_held_blocks == 0 and not engine.has_work


@pytest.mark.parametrize("max_steps", [1, 4096])
def test_requests_finishing_in_one_step_are_reported_oldest_first(max_steps: int) -> None:
    engine = make_engine()
    engine.submit(Request("old", "t0", context_tokens=300, output_tokens=16))
    for _ in range(6):  # the prefill and 5 tokens
        engine.step()
    engine.submit(Request("new", "t1", context_tokens=20, output_tokens=10))
    engine.submit(Request("newer", "t2", context_tokens=40, output_tokens=10))
    engine.step()  # old decodes its 6th token while the others prefill: 10 left each
    results = run_to_end(engine, max_steps)
    finished = [[f.request.request_id for f in r.finished] for r in results if r.finished]
    assert finished == [["old", "new", "newer"]]
    assert sum(r.num_steps for r in results) == 10
