"""One inference engine instance, modelled per request at scheduler-step granularity.

More detailed than the predictor's fluid model: continuous batching as vLLM v1's scheduler
does it, with step times from the runtime profile. The caller (the simulator) owns the
clock: it calls ``step()``, advances its clock by the returned ``duration_s`` and turns the
step's events into its own. Nothing here reads a clock, draws a random number or does I/O.

Scheduling rules of one step (``max_steps=1``):

0. Queued requests whose whole prompt's KV arrived from a prefill instance are admitted
   (same KV check as below) and decode in this very step.
1. **Decode first.** Running sequences whose prompt is fully computed each decode one
   token (one token of the ``max_batched_tokens`` budget), oldest first. A sequence whose
   next token opens a new KV block gets one; when none is free, cached prefixes are
   evicted (LRU), and then the newest running sequence is preempted (vLLM's recompute
   preemption: its blocks are released, its computed full blocks stay as its
   trajectory's cached prefix, and it goes back to the head of the queue with the tokens
   it generated so far, to be prefilled again). A sequence that would preempt itself waits.
2. **Then prefill chunks.** Running sequences with a partly computed prompt get chunks of
   the remaining budget, then queued requests are admitted first come first served while
   the budget lasts, fewer than ``max_num_seqs`` run and the request's whole prompt fits
   in the KV cache (its blocks are reserved on admission; vLLM v1 reserves per chunk).
   Admission stops at the first request that does not fit (no overtaking).
3. **Duration** = ``DecodeCoeffs.step_s(B, sum of the B contexts)`` for the decoded batch
   (a context counts the tokens in KV before the step) plus ``PrefillCoeffs.batch_s(new,
   prefix)`` of the chunks; a step that does work lasts more than 0 s.

Prefix reuse: on admission a request's computed tokens start at its trajectory's cached
prefix (at most the prompt less one token: vLLM recomputes the last one to sample), or
at the KV that arrived from a prefill instance (``kv_ready_tokens``), whichever is more.
When a turn ends, the full blocks of its prompt and output stay cached for the next turn.

A turn of ``o`` output tokens costs its prefill and then ``o`` decode steps (the
predictor's convention, ``docs/predictor.md``). Roles: ``colocated`` and ``decode``
instances both run the rules above (a decode instance is handed requests whose KV
arrived, so they skip the prefill; one preempted there is recomputed locally, as vLLM
does); a ``prefill`` instance ends a request when its prompt is computed (``max_tokens=1``)
and reports a ``KvHandoff`` of its ``context_tokens``.

What a router reads of an instance (``pearl.serving.views``): ``num_requests`` (running and
waiting), ``num_decoding`` and ``decoding_context_tokens`` (the batch decoding a token per
step), ``queued_prefill()`` (the prompt tokens still to compute ahead of a new request, and
their attention's token pairs). These views, the requests' bookkeeping (``submit``,
``abort``, ``drain``, ``abort_all``, ``resume``) and the lazily advanced decoding batch are
``pearl.sim.engine_base.EngineBase``'s, shared with the fluid model; this module holds the
step model's scheduling.

``step(max_steps=k)`` may run up to ``k`` decode steps at once when nothing can change
the batch in between (every running sequence decoding, no admission possible, blocks for
the growth available): the same outcome as ``k`` single steps, in one call whose cost does
not grow with the batch (decoding sequences advance lazily, see ``EngineModel``).

Invariants (asserted by ``tests/sim/test_engine.py`` and, for both models,
``tests/sim/test_engine_invariants.py``):
- held and cached KV never exceed ``kv_capacity_tokens`` (rounded down to blocks);
- every submitted request finishes (or hands off), is queued (after a preemption too),
  or is returned with its partial output by ``abort``, ``drain`` or ``abort_all``: none
  disappears and none is reported twice; ``num_requests`` counts those still here
  (running and waiting);
- a step with work lasts more than 0 s; an idle engine's step lasts 0 s and reports nothing;
- the same calls give the same results, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pearl.core.profile import EngineProfile, RuntimeProfile
from pearl.core.roles import Role
from pearl.serving.requests import Request
from pearl.sim.engine_base import EngineBase, Seq
from pearl.sim.kv_cache import BLOCK_TOKENS, blocks_for


@dataclass(frozen=True, slots=True)
class Finished:
    request: Request
    finish_offset_s: float  # from the start of the step


@dataclass(frozen=True, slots=True)
class KvHandoff:
    """A prefill instance computed a prompt; its KV is ready to go to a decode instance."""

    request: Request
    kv_tokens: int
    ready_offset_s: float  # from the start of the step


@dataclass(frozen=True, slots=True)
class EngineStepResult:
    duration_s: float
    num_steps: int  # scheduler steps this result covers (0 when idle)
    num_decode_seqs: int  # sequences decoded per step
    num_prefill_tokens: int
    num_generated_tokens: int
    finished: tuple[Finished, ...] = ()
    preempted: tuple[str, ...] = ()  # request ids re-queued for recomputation
    handoffs: tuple[KvHandoff, ...] = ()


IDLE_STEP = EngineStepResult(0.0, 0, 0, 0, 0)


def kv_transfer_s(
    tokens: int, profile: RuntimeProfile, gpu_type: str, same_node: bool, tp: int = 1
) -> float:
    """Time to move the KV of ``tokens`` tokens between instances of ``tp`` GPUs each
    (the narrower side's), over NVLink within a node or the network between nodes."""
    gpu = profile.gpus[gpu_type]
    gb_per_s = gpu.kv_transfer_intra_node_gb_per_s if same_node else gpu.kv_transfer_gb_per_s
    return tokens * profile.model.kv_bytes_per_token / (tp * gb_per_s * 1e9)


class EngineModel(EngineBase[Seq]):
    """One engine instance: queue, running batch and KV cache; ``step()`` advances it.

    Bookkeeping for speed (results are those of the plain per-sequence rules): the
    running batch is an insertion-ordered dict (oldest first); sequences still
    prefilling are also kept apart, in the same order; decoding sequences advance lazily
    through the decode-step counter ``_dec`` (``EngineBase``): here a decoding
    sequence's ``num_tokens`` and ``num_computed`` advance with its ``num_generated``
    (its context is ``num_tokens``), and ``_sync`` makes them all true at once.
    """

    def __init__(self, role: Role, engine: EngineProfile, kv_capacity_tokens: int) -> None:
        super().__init__(role, engine, kv_capacity_tokens)
        self._running: dict[Seq, None] = {}  # oldest first
        self._prefilling: dict[Seq, None] = {}  # running with a partly computed prompt

    # --- the running batch (EngineBase's hooks) --------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    def _new_seq(self, request: Request) -> Seq:
        return Seq(request, request.context_tokens, request.kv_ready_tokens)

    def _is_running(self, seq: Seq) -> bool:
        return seq in self._running

    def _running_oldest_first(self) -> list[Seq]:
        return list(self._running)

    def _leave(self, seq: Seq) -> None:
        self._remove_running(seq)
        self._release(seq)

    # --- one step --------------------------------------------------------------------

    def step(self, max_steps: int = 1, max_duration_s: float = math.inf) -> EngineStepResult:
        """Run one scheduler step, or up to ``max_steps`` identical decode steps that end
        within ``max_duration_s`` (at least one step is always run)."""
        if not (self._running or self._waiting):
            return IDLE_STEP
        self._queued = None
        if max_steps > 1:
            num_steps = self._stable_decode_steps(max_steps)
            if num_steps > 1:
                return self._decode_steps(num_steps, max_duration_s)
        return self._single_step()

    def _single_step(self) -> EngineStepResult:
        preempted: list[str] = []
        budget = self.engine.max_batched_tokens
        if self._waiting:
            self._admit_kv_ready()
        num_decoding = len(self._running) - len(self._prefilling)
        ctx = self._ctx
        if num_decoding:
            growth = self._hist[-self._dec % BLOCK_TOKENS]  # blocks one more token opens
            kv = self.kv
            if num_decoding <= budget and growth <= kv.num_blocks - kv.num_held_blocks:
                # every decoding sequence decodes, without eviction or preemption
                if growth:
                    grown = kv.allocate(growth)  # evicts as growing one by one would
                    assert grown, "growth blocks were checked"
                self._dec += 1
                self._ctx += num_decoding
            else:
                num_decoding, ctx = self._schedule_decodes(budget, preempted)
        chunks = self._schedule_prefills(budget - num_decoding) if budget > num_decoding else []
        duration_s = 0.0
        if num_decoding:
            duration_s += self._decode_step_s(num_decoding, ctx)
        num_prefill = 0
        if chunks:
            duration_s += self._prefill_s(chunks)
            for _, n in chunks:
                num_prefill += n
        finished = self._finish(duration_s) if num_decoding else ()
        handoffs = self._advance_prefills(chunks, duration_s) if chunks else ()
        return EngineStepResult(
            duration_s,
            1,
            num_decoding,
            num_prefill,
            num_decoding,
            finished,
            tuple(preempted),
            handoffs,
        )

    def _decode_step_s(self, batch: int, ctx: int) -> float:
        """``DecodeCoeffs.step_s(batch, ctx)`` on scalars, with the same float operations."""
        b = float(batch)
        g = self._regime(batch)
        return g.base_s + g.per_seq_s * b + g.per_ctx_token_s * float(ctx)

    def _prefill_s(self, chunks: list[tuple[Seq, int]]) -> float:
        """``PrefillCoeffs.batch_s`` of the chunks. Its float sums are of whole numbers
        below 2**53 here, hence exact in any order: the same float from integer sums."""
        new = 0
        quad = 0
        top = 0
        for seq, n in chunks:
            p = seq.num_computed
            e = p + n
            new += n
            quad += e * e - p * p
            if e > top:
                top = e
        prefill = self.engine.prefill
        if top < 1 << 26 and quad < 1 << 53:
            return (
                prefill.a_s
                + prefill.b_s_per_token * float(new)
                + prefill.c_s_per_token2 * float(quad)
            )
        return prefill.batch_s([n for _, n in chunks], [s.num_computed for s, _ in chunks])

    # --- scheduling ------------------------------------------------------------------

    def _schedule_decodes(self, budget: int, preempted: list[str]) -> tuple[int, int]:
        """The general decode phase (KV pressure or a token budget short of the batch):
        sequences grow one by one, oldest first, preempting the newest when blocks run
        out. Returns the sequences decoded and their context before the step."""
        self._sync()
        decoding: list[Seq] = []
        running = self._running
        for seq in list(running):
            if len(decoding) >= budget or seq not in running:
                break  # out of budget, or preempted with everything after it
            if not seq.decoding:
                continue  # still prefilling
            if not self._grow(seq, preempted):
                break  # it preempted itself: everything after it is gone too
            decoding.append(seq)
        ctx = 0
        for seq in decoding:
            ctx += seq.num_tokens
        left_out = len(running) - len(self._prefilling) - len(decoding)
        if left_out:
            skipped = [s for s in running if s.decoding and s not in decoding]
            for seq in skipped:
                self._stop_decoding(seq)
            self._dec += 1
            self._ctx += len(decoding)
            for seq in skipped:
                self._start_decoding(seq)
        else:
            self._dec += 1
            self._ctx += len(decoding)
        return len(decoding), ctx

    def _grow(self, seq: Seq, preempted: list[str]) -> bool:
        need = blocks_for(seq.num_tokens + 1) - blocks_for(seq.num_tokens)
        while need > 0 and not self.kv.allocate(need):
            victim = next(reversed(self._running))
            self._remove_running(victim)
            self._preempt(victim)
            preempted.append(victim.request.request_id)
            if victim is seq:
                return False
        return True

    def _schedule_prefills(self, budget: int) -> list[tuple[Seq, int]]:
        chunks: list[tuple[Seq, int]] = []
        for seq in self._prefilling:
            if budget <= 0:
                return chunks
            chunk = min(seq.num_tokens - seq.num_computed, budget)
            chunks.append((seq, chunk))
            budget -= chunk
        waiting = self._waiting
        while budget > 0 and waiting and self._admissible(waiting[0]):
            seq = waiting.popleft()
            self._admit(seq)
            if seq.num_computed < seq.num_tokens:
                chunk = min(seq.num_tokens - seq.num_computed, budget)
                chunks.append((seq, chunk))
                budget -= chunk
        return chunks

    def _admit_kv_ready(self) -> None:
        """Queued requests whose whole prompt's KV arrived join this step's decode."""
        while self._waiting and self._waiting[0].kv_ready_tokens >= self._waiting[0].num_tokens:
            if not self._admissible(self._waiting[0]):
                return
            self._admit(self._waiting.popleft())

    def _admissible(self, seq: Seq) -> bool:
        if len(self._running) >= self.engine.max_num_seqs:
            return False
        need = blocks_for(seq.num_tokens) - self._claimable_blocks(seq)
        return self.kv.can_hold(need, seq.request.traj_id)

    def _claimable_blocks(self, seq: Seq) -> int:
        cached = self.kv.cached_tokens(seq.request.traj_id) // BLOCK_TOKENS
        return min(cached, blocks_for(seq.num_tokens))

    def _admit(self, seq: Seq) -> None:
        traj_id = seq.request.traj_id
        hit_tokens = self._hit_tokens(seq)
        total = blocks_for(seq.num_tokens)
        claimed = self.kv.claim(traj_id, total)
        allocated = self.kv.allocate(total - claimed)
        assert allocated, "admission checked the blocks"
        seq.num_computed = max(hit_tokens, min(seq.kv_ready_tokens, seq.num_tokens))
        self._order += 1
        seq.order = self._order
        self._running[seq] = None
        if seq.num_computed < seq.num_tokens:
            self._prefilling[seq] = None
        else:
            self._start_decoding(seq)

    def _preempt(self, seq: Seq) -> None:
        self._release(seq)
        seq.num_tokens = seq.request.context_tokens + seq.num_generated
        seq.kv_ready_tokens = 0
        self._waiting.appendleft(seq)

    def _release(self, seq: Seq) -> None:
        """A sequence taken off the running batch (its counters true) frees its blocks."""
        self.kv.release(blocks_for(seq.num_tokens), seq.request.traj_id, seq.num_computed)
        seq.num_computed = 0

    # --- bookkeeping of the running batch --------------------------------------------

    def _start_decoding(self, seq: Seq) -> None:
        """A running sequence with its counters true and its prompt computed decodes."""
        self._join_decoding(seq, seq.num_tokens)

    def _stop_decoding(self, seq: Seq) -> None:
        """Make the counters of a decoding sequence true and take it off the aggregates."""
        delta = self._dec - seq.mark
        if delta:
            seq.num_tokens += delta
            seq.num_computed += delta
            seq.num_generated += delta
        self._leave_decoding(seq, seq.num_tokens)

    def _sync(self) -> None:
        """Make every decoding sequence's stored counters true (aggregates unchanged)."""
        dec = self._dec
        for seq in self._running:
            if seq.decoding:
                delta = dec - seq.mark
                if delta:
                    seq.num_tokens += delta
                    seq.num_computed += delta
                    seq.num_generated += delta
                    seq.mark = dec

    def _remove_running(self, seq: Seq) -> None:
        del self._running[seq]
        if seq.decoding:
            self._stop_decoding(seq)
        else:
            del self._prefilling[seq]

    # --- applying a step -------------------------------------------------------------

    def _finish(self, duration_s: float) -> tuple[Finished, ...]:
        """Retire the decoding sequences that generated their last token."""
        done = self._due()
        if not done:
            return ()
        for seq in done:
            self._retire(seq)
        return tuple([Finished(seq.request, duration_s) for seq in done])

    def _advance_prefills(
        self, chunks: list[tuple[Seq, int]], duration_s: float
    ) -> tuple[KvHandoff, ...]:
        for seq, chunk in chunks:
            seq.num_computed += chunk
        if self.role is not Role.PREFILL:
            for seq, _ in chunks:
                if seq.num_computed >= seq.num_tokens:
                    del self._prefilling[seq]
                    self._start_decoding(seq)
            return ()
        done = [s for s, _ in chunks if s.num_computed >= s.num_tokens]
        for seq in done:
            self._retire(seq)
        return tuple(KvHandoff(s.request, s.num_tokens, duration_s) for s in done)

    # --- several decode steps at once ------------------------------------------------

    def _stable_decode_steps(self, max_steps: int) -> int:
        """How many decode steps can run with the batch unchanged (1 if not several)."""
        if (
            self.role is Role.PREFILL
            or self._prefilling
            or len(self._running) > self.engine.max_batched_tokens
        ):
            return 1
        num_steps = max_steps
        finish_dec = self._next_finish_dec()
        if finish_dec is not None:
            num_steps = min(num_steps, finish_dec - self._dec)
        if num_steps <= 1:
            return 1
        if self._waiting and self._admissible(self._waiting[0]):
            return 1
        kv = self.kv
        available = kv.num_blocks - kv.num_held_blocks
        while num_steps > 1 and self._growth_blocks(num_steps) > available:
            num_steps //= 2
        return num_steps

    def _decode_steps(self, num_steps: int, max_duration_s: float) -> EngineStepResult:
        batch = len(self._running)
        ctx = self._ctx
        decode = self.engine.decode
        b = float(batch)
        g = self._regime(batch)
        c0 = g.base_s + g.per_seq_s * b
        ck = g.per_ctx_token_s
        # the cumulative step times one by one, as np.cumsum adds them, while few
        duration_s = c0 + ck * float(ctx)
        n = 1
        limit = min(num_steps, _LOOP_STEPS)
        while n < limit:
            end_s = duration_s + (c0 + ck * float(ctx + batch * n))
            if end_s > max_duration_s:
                break
            duration_s = end_s
            n += 1
        else:
            if n < num_steps:  # many steps within the bound: vectorised
                times_s = decode.step_s(batch, ctx + batch * np.arange(num_steps))
                ends_s = np.cumsum(times_s)
                count = int(np.searchsorted(ends_s, max_duration_s, "right"))
                n = max(1, min(num_steps, count))
                duration_s = float(ends_s[n - 1])
        num_steps = n
        grown = self.kv.allocate(self._growth_blocks(num_steps))  # evicts as one by one
        assert grown, "growth blocks were checked"
        self._dec += num_steps
        self._ctx += batch * num_steps
        finished = self._finish(duration_s)
        return EngineStepResult(duration_s, num_steps, batch, 0, batch * num_steps, finished)


_LOOP_STEPS = 64  # multi-step calls of up to this many steps time them without numpy
