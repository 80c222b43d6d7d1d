"""Expected times on one instance (pearl.serving.costs) against the profile's formulas."""

from __future__ import annotations

import math
from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pearl.core.profile import EngineProfile
from pearl.io.documents import load_profile
from pearl.serving.costs import (
    attention_pairs,
    decode_step_s,
    decode_token_s,
    expected_wait_s,
    fastest_prompt_s,
    fastest_token_s,
    prefill_time_s,
    prompt_ready_s,
    reusable_prefix_tokens,
    turn_s,
)
from pearl.serving.views import InstanceQueue


@cache
def h20() -> EngineProfile:
    engine = load_profile("qwen3-8b").engine("h20", 1)
    assert engine is not None
    return engine


@cache
def h800_tp2() -> EngineProfile:
    engine = load_profile("qwen3-8b").engine("h800", 2)
    assert engine is not None
    return engine


def test_one_chunk_with_nothing_decoding_is_the_profiles_prefill_batch() -> None:
    e = h20()
    for new, prefix in [(1, 0), (900, 7000), (8192, 0), (100, 20000)]:
        got = prefill_time_s(e, new, attention_pairs(new, prefix))
        assert got == pytest.approx(e.prefill.batch_s([new], [prefix]), rel=1e-12)


def test_a_long_prefill_pays_one_batch_and_one_decode_step_per_chunk() -> None:
    e = h20()
    batch, ctx = 100, 800_000
    per_step = e.max_batched_tokens - batch
    tokens = 3 * per_step + 1  # four steps
    pairs = attention_pairs(tokens, 0)
    step_s = float(e.decode.step_s(batch, ctx)) + e.prefill.a_s
    expected = 4 * step_s + e.prefill.b_s_per_token * tokens + e.prefill.c_s_per_token2 * pairs
    assert prefill_time_s(e, tokens, pairs, batch, ctx) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("batch", [0, 1, 37, 38, 256])
def test_decode_step_matches_the_profiles_vectorised_form(batch: int) -> None:
    e = h20()
    ctx = batch * 6000
    expected = float(e.decode.step_s(batch, ctx)) if batch else 0.0
    assert decode_step_s(e.decode, batch, ctx) == pytest.approx(expected, rel=1e-12)


def test_nothing_queued_waits_nothing_and_a_full_step_budget_waits_forever() -> None:
    e = h20()
    assert expected_wait_s(InstanceQueue(e)) == 0.0
    assert expected_wait_s(InstanceQueue(e, 0, 0, decoding_seqs=200)) == 0.0
    starved = InstanceQueue(e, 100, attention_pairs(100, 0), decoding_seqs=e.max_batched_tokens)
    assert expected_wait_s(starved) == math.inf


def test_the_reused_prefix_leaves_at_least_one_token_to_compute() -> None:
    assert reusable_prefix_tokens(5000, 8000) == 5000
    assert reusable_prefix_tokens(8000, 8000) == 7999
    assert reusable_prefix_tokens(9000, 8000) == 7999
    assert reusable_prefix_tokens(0, 8000) == 0


def test_prompt_ready_is_the_queue_then_the_tokens_beyond_the_prefix() -> None:
    e = h20()
    queue = InstanceQueue(e, 2000, attention_pairs(2000, 0))
    prompt, prefix = 8000, 7000
    alone = prompt_ready_s(InstanceQueue(e), prompt, prefix)
    assert alone == pytest.approx(e.prefill.batch_s([1000], [7000]), rel=1e-12)
    ready = prompt_ready_s(queue, prompt, prefix)
    assert ready > expected_wait_s(queue) and ready > alone
    # both fit one step's budget: one batch of the queued chunk and the new tokens
    assert ready == pytest.approx(e.prefill.batch_s([2000, 1000], [0, 7000]), rel=1e-12)


def test_the_fastest_prompt_is_the_fastest_engines_whole_prompt() -> None:
    prompt = 8000
    engines = [h20(), h800_tp2()]
    floor = fastest_prompt_s(engines, prompt)
    times = [prompt_ready_s(InstanceQueue(e), prompt) for e in engines]
    assert floor == min(times) and times[1] < times[0]  # the H800 pair computes faster
    assert fastest_prompt_s([], prompt) == 0.0


counts = st.integers(min_value=0, max_value=200_000)


@given(tokens=counts, extra=st.integers(0, 50_000), batch=st.integers(0, 300), ctx=counts)
def test_prefill_time_grows_with_tokens_and_with_the_decoding_batch(
    tokens: int, extra: int, batch: int, ctx: int
) -> None:
    e = h20()
    pairs = attention_pairs(tokens, 0)
    t = prefill_time_s(e, tokens, pairs, batch, ctx)
    assert t >= 0.0 and (tokens > 0 or t == 0.0)
    more = tokens + extra
    assert prefill_time_s(e, more, attention_pairs(more, 0), batch, ctx) >= t
    assert prefill_time_s(e, tokens, pairs, batch + 1, ctx + 6000) >= t


def test_a_new_sequence_decodes_in_the_batch_of_everything_held_before_it() -> None:
    e = h20()
    alone = decode_token_s(InstanceQueue(e), 8000)
    assert alone == pytest.approx(float(e.decode.step_s(1, 8000)), rel=1e-12)
    # 10 decoding sequences of 5,000 tokens and 5 more waiting or incoming (taken as 8,000)
    queue = InstanceQueue(e, 0, 0, decoding_seqs=10, decoding_context_tokens=50_000, batch_seqs=15)
    expected = float(e.decode.step_s(16, 50_000 + 6 * 8000))
    assert decode_token_s(queue, 8000) == pytest.approx(expected, rel=1e-12)
    # at most max_num_seqs decode together
    full = InstanceQueue(e, 0, 0, 300, 300 * 5000, batch_seqs=400)
    n = e.max_num_seqs
    expected = float(e.decode.step_s(n, (n - 1) * 5000 + 8000))
    assert decode_token_s(full, 8000) == pytest.approx(expected, rel=1e-12)


def test_a_turn_is_its_prompt_then_its_expected_output_at_the_per_token_time() -> None:
    e = h20()
    queue = InstanceQueue(e, 0, 0, 20, 160_000, batch_seqs=20)
    assert turn_s(1.5, queue, 8000, 262.0) == pytest.approx(
        1.5 + 262.0 * decode_token_s(queue, 8000), rel=1e-12
    )
    assert turn_s(1.5, queue, 8000, 0.0) == 1.5


@given(
    decoding=st.integers(0, 300),
    extra=st.integers(0, 100),
    per_seq_ctx=st.integers(1, 30_000),
    context=st.integers(1, 30_000),
    tokens=st.integers(1, 30_000),
)
def test_the_floors_are_below_every_instance_they_bound(
    decoding: int, extra: int, per_seq_ctx: int, context: int, tokens: int
) -> None:
    for e in (h20(), h800_tp2()):
        queue = InstanceQueue(e, 0, 0, decoding, decoding * per_seq_ctx, decoding + extra)
        assert fastest_token_s([h20(), h800_tp2()], context) <= decode_token_s(queue, context)
        assert fastest_prompt_s([h20(), h800_tp2()], tokens) <= prompt_ready_s(queue, tokens)
