"""Expected times on one instance, from its engine profile and what it holds.

**Prefill.** The step rule is vLLM v1's (as ``pearl.sim.engine`` models it): every
scheduler step first decodes one token of each decoding sequence, each taking one token of
the step's ``max_batched_tokens`` budget, then fills the rest of the budget with prefill
chunks, first come first served. So ``t`` prefill tokens (their attention computing ``q``
token pairs) on an instance decoding ``B`` sequences of ``K`` context tokens in all need

    steps = ceil(t / (max_batched_tokens - B))
    prefill_time_s = steps * (decode_step_s(B, K) + a) + b * t + c * q

with ``a, b, c`` the instance's ``PrefillCoeffs`` and ``decode_step_s`` its
``DecodeCoeffs.step_s`` (0 when nothing decodes): each step pays the decode of the batch
and a prefill batch's fixed cost, and the tokens and pairs are paid once, however they are
chunked. ``expected_wait_s`` is that time for the prefill queued ahead of a new request
(it is admitted once the work ahead is done); ``prompt_ready_s`` adds the request's own
prompt, less the prefix of its trajectory cached there: the expected time to its first
token.

**Decode.** A new sequence of context ``C`` decodes in the batch of every request the
instance holds or will hold before it (``InstanceQueue.batch_seqs``, itself included, at
most ``max_num_seqs``): ``n = min(batch_seqs + 1, max_num_seqs)`` sequences holding the
decoding batch's context and ``C`` for each of the others (taken to be like it), so each
of its tokens costs ``decode_step_s(n, K)`` (``decode_token_s``). ``turn_s`` is the time to
the end of a turn: its prompt ready, then its expected output tokens at the per-token time
of the instance that decodes it (itself when colocated, a decode instance's when prefill).

**Stall.** The steps that carry a prompt's chunks carry the decode of the instance's batch
too, and take the chunks' time on top: each of its ``B`` decoding sequences waits
``prefill_time_s`` of the prompt alone (nothing decoding beside it). ``stall_s`` is that
delay summed over them, the cost a prompt puts on the others there: a returning turn's
few new tokens at its home, its whole context recomputed elsewhere.

Floors (the routing rule's shortcut): ``fastest_prompt_s`` is the least ``prompt_ready_s``
of a prompt with nothing cached on any of a set of engines, ``fastest_token_s`` the least
per-token decode time of a sequence of that context on any of them (the cheaper of the
small regime at one sequence and the large regime at its first batch size: each regime's
time grows with the batch and the context).

Deliberate simplifications (the error they make is the same on every instance, so a
comparison between two instances keeps most of its sign): the batch is taken as it is now
(sequences grow, finish and join); the rest of a step in flight is not counted; a full
batch's wait for a free slot and KV room are not modelled; the turn's own output length
is its expectation, not its sampled value.

Invariants: every time is >= 0, 0 for no prefill tokens, and does not decrease when
tokens, pairs, the batch or its context grow; a batch that uses the whole step budget
makes prefill wait forever (``math.inf``); a floor is at most the time it bounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pearl.core.profile import DecodeCoeffs, EngineProfile
from pearl.serving.views import InstanceQueue


def attention_pairs(new_tokens: int, prefix_tokens: int) -> int:
    """Token pairs a prefill of ``new_tokens`` after ``prefix_tokens`` cached ones computes."""
    end = prefix_tokens + new_tokens
    return end * end - prefix_tokens * prefix_tokens


def decode_step_s(decode: DecodeCoeffs, batch: int, context_tokens: int) -> float:
    """``DecodeCoeffs.step_s`` of one step, on scalars; 0 s for an empty batch."""
    if batch <= 0:
        return 0.0
    g = decode.small if batch < decode.large_batch_from else decode.large
    return g.base_s + g.per_seq_s * batch + g.per_ctx_token_s * context_tokens


def prefill_time_s(
    engine: EngineProfile,
    tokens: int,
    pairs: int,
    decoding_seqs: int = 0,
    decoding_context_tokens: int = 0,
) -> float:
    """Time to compute ``tokens`` prefill tokens (``pairs`` attention pairs) beside a
    decoding batch (the module docstring's formula)."""
    if tokens <= 0:
        return 0.0
    per_step_tokens = engine.max_batched_tokens - max(decoding_seqs, 0)
    if per_step_tokens <= 0:
        return math.inf
    steps = -(-tokens // per_step_tokens)
    p = engine.prefill
    step_s = decode_step_s(engine.decode, decoding_seqs, decoding_context_tokens) + p.a_s
    return steps * step_s + p.b_s_per_token * tokens + p.c_s_per_token2 * pairs


def expected_wait_s(queue: InstanceQueue) -> float:
    """Time until a request arriving now is admitted: the prefill queued ahead of it."""
    return prefill_time_s(
        queue.engine,
        queue.queued_prefill_tokens,
        queue.queued_prefill_pairs,
        queue.decoding_seqs,
        queue.decoding_context_tokens,
    )


def reusable_prefix_tokens(cached_prefix_tokens: int, prompt_tokens: int) -> int:
    """The cached prefix a prompt of ``prompt_tokens`` reuses: at most the prompt less one
    token (the engine recomputes the last one to sample the first output)."""
    return max(0, min(cached_prefix_tokens, prompt_tokens - 1))


def prompt_ready_s(
    queue: InstanceQueue, prompt_tokens: int, cached_prefix_tokens: int = 0
) -> float:
    """Expected time until a prompt of ``prompt_tokens`` sent there now is computed: the
    queue ahead, then its tokens beyond the trajectory's prefix cached there."""
    prefix = reusable_prefix_tokens(cached_prefix_tokens, prompt_tokens)
    new = prompt_tokens - prefix
    return prefill_time_s(
        queue.engine,
        queue.queued_prefill_tokens + new,
        queue.queued_prefill_pairs + attention_pairs(new, prefix),
        queue.decoding_seqs,
        queue.decoding_context_tokens,
    )


def stall_s(queue: InstanceQueue, prompt_tokens: int, cached_prefix_tokens: int = 0) -> float:
    """The delay a prompt sent there now adds to the instance's decoding batch, summed
    over its sequences: each decodes in the steps that carry the prompt's chunks, which
    take the chunks' time on top of the decode's (0 where nothing decodes)."""
    if queue.decoding_seqs <= 0:
        return 0.0
    prefix = reusable_prefix_tokens(cached_prefix_tokens, prompt_tokens)
    new = prompt_tokens - prefix
    chunks_s = prefill_time_s(queue.engine, new, attention_pairs(new, prefix))
    return queue.decoding_seqs * chunks_s


def decode_token_s(queue: InstanceQueue, context_tokens: int) -> float:
    """Expected time per output token of a new sequence of ``context_tokens`` decoding
    there, in the batch of everything the instance holds or will hold before it."""
    engine = queue.engine
    n = min(queue.batch_seqs + 1, engine.max_num_seqs)
    known = min(queue.decoding_seqs, n - 1)
    ctx = context_tokens * (n - known)
    if known:
        ctx += queue.decoding_context_tokens * known // queue.decoding_seqs
    return decode_step_s(engine.decode, n, ctx)


def turn_s(
    ready_s: float, decode_queue: InstanceQueue, context_tokens: int, output_tokens: float
) -> float:
    """Expected time to a turn's end: its prompt ready after ``ready_s``, then
    ``output_tokens`` tokens decoded where ``decode_queue`` says."""
    return ready_s + output_tokens * decode_token_s(decode_queue, context_tokens)


def fastest_prompt_s(engines: Iterable[EngineProfile], prompt_tokens: int) -> float:
    """The least time any of ``engines`` takes for a whole prompt of ``prompt_tokens``
    (nothing cached, queued or decoding): a floor under ``prompt_ready_s`` of that prompt
    on an instance of one of them that caches none of it; 0 for no engine."""
    pairs = attention_pairs(prompt_tokens, 0)
    return min((prefill_time_s(e, prompt_tokens, pairs) for e in engines), default=0.0)


def fastest_token_s(engines: Iterable[EngineProfile], context_tokens: int) -> float:
    """A floor under ``decode_token_s`` of a sequence of ``context_tokens`` on any of
    ``engines`` (see the module docstring); 0 for no engine."""
    floors = []
    for e in engines:
        d = e.decode
        floors.append(decode_step_s(d, 1, context_tokens))
        large = d.large
        floors.append(
            large.base_s
            + large.per_seq_s * d.large_batch_from
            + large.per_ctx_token_s * context_tokens
        )
    return min(floors, default=0.0)
