"""The engine models' test inputs (a plain module): one engine profile and a driver.

``engine_profile`` is an 8B-like model on one GPU with round, plausible coefficients
(not measurements); ``run_to_end`` steps an engine of either model until it has no work,
checking at every call ``EngineBase``'s invariants (``check_books``), that the call
lasts more than 0 s and that the KV cache holds no more than its capacity.
"""

from __future__ import annotations

import math

from pearl.core.profile import DecodeCoeffs, DecodeRegime, EngineProfile, PrefillCoeffs
from pearl.sim.engine import EngineModel, EngineStepResult
from pearl.sim.fluid_engine import FluidEngineModel
from pearl.sim.kv_cache import BLOCK_TOKENS

CAPACITY_TOKENS = 100_000


def engine_profile(max_batched_tokens: int = 8192, max_num_seqs: int = 256) -> EngineProfile:
    """Round, plausible coefficients of an 8B-like model on one GPU (not measurements)."""
    return EngineProfile(
        tp=1,
        prefill=PrefillCoeffs(a_s=0.01, b_s_per_token=5e-5, c_s_per_token2=1e-10),
        decode=DecodeCoeffs(
            small=DecodeRegime(base_s=0.010, per_seq_s=5e-5, per_ctx_token_s=1e-8),
            large=DecodeRegime(base_s=0.008, per_seq_s=8e-5, per_ctx_token_s=1e-8),
            large_batch_from=64,
        ),
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        kv_capacity_tokens=CAPACITY_TOKENS,
    )


def run_to_end(
    engine: EngineModel | FluidEngineModel,
    max_steps: int = 1,
    bound_s: float = math.inf,
    limit: int = 100_000,
) -> list[EngineStepResult]:
    """Step the engine (``step(max_steps, bound_s)``) until it has no work left."""
    results = []
    while engine.has_work:
        check_books(engine)
        results.append(engine.step(max_steps, bound_s))
        assert engine.kv_used_tokens <= engine.kv.num_blocks * BLOCK_TOKENS
        assert results[-1].duration_s > 0.0
        assert len(results) < limit, "engine does not make progress"
    check_books(engine)
    return results


def check_books(engine: EngineModel | FluidEngineModel) -> None:
    """``EngineBase``'s invariants: the requests counted are those on the books, running
    and waiting; the histogram counts the decoding sequences and ``_ctx`` sums their true
    context (each model's counters: the fluid model's prompt does not grow as it decodes)."""
    assert engine.num_requests == len(engine.request_ids())
    assert engine.num_requests == engine.num_running + engine.num_waiting
    decoding = [seq for seq in engine._by_id.values() if seq.decoding]
    assert sum(engine._hist[:BLOCK_TOKENS]) == len(decoding) == engine.num_decoding
    assert engine._hist[:BLOCK_TOKENS] == engine._hist[BLOCK_TOKENS:]
    context_tokens = 0
    for seq in decoding:
        context_tokens += seq.num_tokens + engine._dec - seq.mark
        if isinstance(engine, FluidEngineModel):  # its prompt does not grow as it decodes
            context_tokens += seq.num_generated - seq.in_prompt
    assert engine.decoding_context_tokens == context_tokens
