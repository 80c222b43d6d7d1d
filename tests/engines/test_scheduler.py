"""The reference engine's KV blocks and scheduler on their own: reference counts, prefix
reuse and eviction; continuous batching, chunked prefill under the token budget,
admission that waits for blocks, and preemption by recompute."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from pearl.engines.reference.blocks import BlockManager, chain_hashes
from pearl.engines.reference.scheduler import Scheduler, SchedulerConfig
from pearl.engines.reference.sequence import SamplingParams, Seq, Status

BS = 4


def _seq(rid: str, prompt_tokens: int, first: int = 0) -> Seq:
    prompt = list(range(first, first + prompt_tokens))
    return Seq(rid, prompt, SamplingParams(max_tokens=100), lambda e: None, 0.0)


def _run(sched: Scheduler, plan: list[tuple[Seq, int]], bm: BlockManager) -> None:
    """What the engine does after a step: the tokens count as computed, full blocks get
    their hashes, and a sequence at the end of its tokens samples one more."""
    for seq, n in plan:
        seq.num_computed += n
        hashes = chain_hashes(seq.all_ids[: seq.num_computed], BS)
        for b, h in enumerate(hashes):
            bm.register(seq.blocks[b], h)
        if seq.pending == 0:
            seq.output_ids.append(7)


def test_blocks_are_shared_by_reference_and_evicted_least_recently_freed_first() -> None:
    bm = BlockManager(4, BS)
    a = bm.allocate(2)
    assert a is not None and bm.free_blocks == 2 and bm.usage() == 0.5
    tokens = list(range(8))
    for block, h in zip(a, chain_hashes(tokens, BS), strict=True):
        bm.register(block, h)
    bm.free(a)
    assert bm.free_blocks == 4  # free, but still cached
    hit = bm.cached_prefix([*tokens, 99], 9)
    assert hit == a
    bm.take_prefix(hit, 9)
    assert (bm.queries_tokens, bm.hits_tokens, bm.free_blocks) == (9, 8, 2)
    bm.free(hit)
    fresh = bm.allocate(3)  # the two never-cached blocks first, then the oldest cached
    assert fresh is not None and set(a) & set(fresh) == {a[1]}
    assert bm.cached_prefix(tokens, 8) == [a[0]]  # the first block's hash survived
    assert bm.allocate(2) is None and bm.free_blocks == 1  # not enough: nothing taken
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free([fresh[0], fresh[0]])


def test_requests_join_the_running_batch_and_long_prompts_are_chunked() -> None:
    bm = BlockManager(64, BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), bm)
    long = _seq("long", 25)
    sched.add(long)
    plan = sched.schedule()
    assert plan == [(long, 10)]
    _run(sched, plan, bm)
    short = _seq("short", 3, first=100)
    sched.add(short)  # arrives while the long prompt is being prefilled
    plan = sched.schedule()
    assert plan == [(long, 10)]  # the budget is spent on the running sequence first
    _run(sched, plan, bm)
    plan = sched.schedule()
    assert plan == [(long, 5), (short, 3)]  # the rest of the prompt, and the newcomer joins
    _run(sched, plan, bm)
    plan = sched.schedule()
    assert plan == [(long, 1), (short, 1)]  # both decode in one step
    assert all(s.status is Status.RUNNING for s in (long, short))


def test_a_cached_prefix_is_not_computed_again() -> None:
    bm = BlockManager(64, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100), bm)
    turn1 = _seq("t1", 10)
    sched.add(turn1)
    _run(sched, sched.schedule(), bm)
    sched.remove(turn1)
    turn2 = Seq("t2", [*turn1.all_ids, 50, 51, 52], SamplingParams(max_tokens=5), print, 0.0)
    sched.add(turn2)
    plan = sched.schedule()
    # turn 1's 10 prompt tokens + its sampled token: 11 tokens, of which 2 full blocks
    assert plan == [(turn2, len(turn2.all_ids) - 8)]
    assert turn2.cached_prompt_tokens == 8 and bm.hits_tokens == 8


def test_admission_waits_when_blocks_run_out_and_decode_preempts_the_newest() -> None:
    bm = BlockManager(4, BS)  # 16 token slots
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    a, b, c = _seq("a", 8), _seq("b", 7, first=50), _seq("c", 9, first=80)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert [s.request_id for s, _ in plan] == ["a", "b"]  # c's 3 blocks do not fit
    assert list(sched.waiting) == [c]
    _run(sched, plan, bm)
    # a needs a third block for its 9th token: none free, so b (the newest) is preempted
    plan = sched.schedule()
    assert sched.num_preemptions == 1
    assert b.status is Status.WAITING and b.num_computed == 0 and not b.blocks
    assert list(sched.waiting) == [b, c] and plan == [(a, 1)]  # b does not fit yet
    # b comes back with its sampled token, to be computed again from scratch
    assert b.output_ids == [7] and b.pending == 8
