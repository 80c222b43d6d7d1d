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
their attention's token pairs).

``step(max_steps=k)`` may run up to ``k`` decode steps at once when nothing can change
the batch in between (every running sequence decoding, no admission possible, blocks for
the growth available): the same outcome as ``k`` single steps, in one call whose cost does
not grow with the batch (decoding sequences advance lazily, see ``EngineModel``).

Invariants (asserted by ``tests/sim/test_engine.py``):
- held and cached KV never exceed ``kv_capacity_tokens`` (rounded down to blocks);
- every submitted request finishes (or hands off), is queued (after a preemption too),
  or is returned with its partial output by ``abort``, ``drain`` or ``abort_all``: none
  disappears and none is reported twice; ``num_requests`` counts those still here
  (running and waiting);
- a step with work lasts more than 0 s; an idle engine's step lasts 0 s and reports nothing;
- the same calls give the same results, bit for bit.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pearl.core.profile import EngineProfile, RuntimeProfile
from pearl.core.roles import INFERENCE_ROLES, Role
from pearl.serving.requests import PartialOutput, Request
from pearl.sim.kv_cache import BLOCK_TOKENS, KvCache, blocks_for


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


@dataclass(slots=True, eq=False)
class _Seq:
    """A request on this instance. While it decodes (``decoding``), its counters are kept
    lazily: the true ones are the stored ones plus ``EngineModel._dec - mark``, the decode
    steps the whole decoding batch ran since the sequence last synced (``_true``)."""

    request: Request
    num_tokens: int  # prompt to compute: context plus tokens generated before a preemption
    num_generated: int = 0
    num_computed: int = 0  # tokens whose KV is held (its blocks: blocks_for(num_tokens))
    kv_ready_tokens: int = field(default=0)
    decoding: bool = False  # running with its prompt computed: counters are lazy
    mark: int = 0  # EngineModel._dec when the stored counters were true
    order: int = 0  # admission order (the running batch's order)
    cls: int = 0  # (num_tokens - mark) % BLOCK_TOKENS while decoding
    entry: tuple[int, int, _Seq] | None = None  # its live entry in the finish heap


def kv_transfer_s(
    tokens: int, profile: RuntimeProfile, gpu_type: str, same_node: bool, tp: int = 1
) -> float:
    """Time to move the KV of ``tokens`` tokens between instances of ``tp`` GPUs each
    (the narrower side's), over NVLink within a node or the network between nodes."""
    gpu = profile.gpus[gpu_type]
    gb_per_s = gpu.kv_transfer_intra_node_gb_per_s if same_node else gpu.kv_transfer_gb_per_s
    return tokens * profile.model.kv_bytes_per_token / (tp * gb_per_s * 1e9)


class EngineModel:
    """One engine instance: queue, running batch and KV cache; ``step()`` advances it.

    Bookkeeping for speed (results are those of the plain per-sequence rules): the
    running batch is an insertion-ordered dict (oldest first); sequences still
    prefilling are also kept apart, in the same order; decoding sequences advance lazily
    through the decode-step counter ``_dec`` (``_Seq``), with their total context, a
    histogram of their token counts modulo the block size (for the blocks ``k`` more
    tokens need) and a heap of the ``_dec`` at which each finishes kept up to date.
    """

    def __init__(self, role: Role, engine: EngineProfile, kv_capacity_tokens: int) -> None:
        if role not in INFERENCE_ROLES:
            raise ValueError(f"role: {role} is not an inference role")
        self.role = role
        self.engine = engine
        self.kv = KvCache(kv_capacity_tokens)
        self._waiting: deque[_Seq] = deque()
        self._running: dict[_Seq, None] = {}  # oldest first
        self._prefilling: dict[_Seq, None] = {}  # running with a partly computed prompt
        self._by_id: dict[str, _Seq] = {}
        self.num_requests = 0  # running and waiting: len(self._by_id), read per route
        # called after every change of num_requests (a router's index of loads)
        self.on_requests_changed: Callable[[], None] | None = None
        self._accepting = True
        self._dec = 0  # decode steps run by the decoding sequences, lazily applied
        self._ctx = 0  # true num_tokens summed over the decoding sequences
        # decoding sequences per _Seq.cls, twice over (a rotation is a contiguous slice)
        self._hist = [0] * (2 * BLOCK_TOKENS)
        self._heap: list[tuple[int, int, _Seq]] = []  # (finish at _dec, order, seq)
        self._order = 0
        self._queued: tuple[int, int] | None = None  # queued_prefill() until a change

    @classmethod
    def from_profile(
        cls, role: Role, profile: RuntimeProfile, gpu_type: str, tp: int
    ) -> EngineModel:
        engine = profile.engine(gpu_type, tp)
        if engine is None:
            raise ValueError(f"profile has no engine for {gpu_type} tp={tp}")
        return cls(role, engine, profile.kv_capacity_tokens(gpu_type, tp))

    # --- state -----------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_used_tokens(self) -> int:
        """Tokens' worth of blocks held or cached (block granularity)."""
        return (self.kv.num_held_blocks + self.kv.num_cached_blocks) * BLOCK_TOKENS

    @property
    def num_decoding(self) -> int:
        """Running sequences whose prompt is computed (each decodes a token per step)."""
        return len(self._running) - len(self._prefilling)

    @property
    def decoding_context_tokens(self) -> int:
        """Tokens in KV of the decoding sequences, summed."""
        return self._ctx

    def queued_prefill(self) -> tuple[int, int]:
        """The prefill work ahead of a request queued now: the prompt tokens still to
        compute of the sequences prefilling and waiting (a waiting one less the prefix it
        would reuse now, or the KV that arrived for it), and the token pairs their
        attention computes (``(p + n)**2 - p**2`` for ``n`` new after ``p`` computed).
        Kept until the next step, submit or abort (nothing else changes it)."""
        if self._queued is not None:
            return self._queued
        tokens = 0
        pairs = 0
        for seq in self._prefilling:
            p, e = seq.num_computed, seq.num_tokens
            tokens += e - p
            pairs += e * e - p * p
        for seq in self._waiting:
            e = seq.num_tokens
            hit = min(self.kv.cached_tokens(seq.request.traj_id), e - 1)
            p = max(hit, min(seq.kv_ready_tokens, e))
            tokens += e - p
            pairs += e * e - p * p
        self._queued = (tokens, pairs)
        return self._queued

    def num_generated(self, request_id: str) -> int:
        seq = self._by_id[request_id]
        if seq.decoding:
            return seq.num_generated + self._dec - seq.mark
        return seq.num_generated

    def cached_tokens(self, traj_id: str) -> int:
        return self.kv.cached_tokens(traj_id)

    def request_ids(self) -> set[str]:
        """Every request on this instance, queued or running."""
        return set(self._by_id)

    def generated_by_request(self) -> list[tuple[Request, int]]:
        """Every request on this instance with the tokens it generated here so far."""
        return [(seq.request, self.num_generated(rid)) for rid, seq in self._by_id.items()]

    # --- requests in and out ---------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request (a decode instance: once its KV has arrived)."""
        if not self._accepting:
            raise ValueError(f"{request.request_id}: instance is draining")
        if request.request_id in self._by_id:
            raise ValueError(f"{request.request_id}: already on this instance")
        if request.context_tokens < 1 or request.output_tokens < 1:
            raise ValueError(f"{request.request_id}: needs a prompt and an output token")
        peak = request.context_tokens
        if self.role is not Role.PREFILL:
            peak += request.output_tokens
        if blocks_for(peak) > self.kv.num_blocks:
            raise ValueError(f"{request.request_id}: {peak} tokens never fit the KV cache")
        seq = _Seq(request, request.context_tokens, kv_ready_tokens=request.kv_ready_tokens)
        self._queued = None
        self._waiting.append(seq)
        self._by_id[request.request_id] = seq
        self.num_requests += 1
        if self.on_requests_changed is not None:
            self.on_requests_changed()

    def abort(self, request_id: str) -> PartialOutput | None:
        """Take one request off, wherever it is; None if it is not here."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        self._queued = None
        if seq in self._running:
            self._remove_running(seq)
            self._release(seq)
        else:
            self._waiting.remove(seq)
        return self._forget(seq)

    def drain(self) -> tuple[PartialOutput, ...]:
        """Stop accepting requests and hand back the queued ones; running ones finish
        (a sequence preempted while draining is recomputed here, not handed back)."""
        self._accepting = False
        self._queued = None
        return self._take_waiting()

    def abort_all(self) -> tuple[PartialOutput, ...]:
        """Take every request off (running first, oldest first), e.g. before a switch."""
        self._queued = None
        running = list(self._running)
        for seq in running:
            self._remove_running(seq)
            self._release(seq)
        return tuple(self._forget(s) for s in running) + self._take_waiting()

    def resume(self) -> None:
        """Accept requests again after ``drain`` (a drain that was cancelled)."""
        self._accepting = True

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
        decode = self.engine.decode
        b = float(batch)
        g = decode.small if b < decode.large_batch_from else decode.large
        return g.base_s + g.per_seq_s * b + g.per_ctx_token_s * float(ctx)

    def _prefill_s(self, chunks: list[tuple[_Seq, int]]) -> float:
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
        decoding: list[_Seq] = []
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

    def _grow(self, seq: _Seq, preempted: list[str]) -> bool:
        need = blocks_for(seq.num_tokens + 1) - blocks_for(seq.num_tokens)
        while need > 0 and not self.kv.allocate(need):
            victim = next(reversed(self._running))
            self._remove_running(victim)
            self._preempt(victim)
            preempted.append(victim.request.request_id)
            if victim is seq:
                return False
        return True

    def _schedule_prefills(self, budget: int) -> list[tuple[_Seq, int]]:
        chunks: list[tuple[_Seq, int]] = []
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

    def _admissible(self, seq: _Seq) -> bool:
        if len(self._running) >= self.engine.max_num_seqs:
            return False
        need = blocks_for(seq.num_tokens) - self._claimable_blocks(seq)
        return self.kv.can_hold(need, seq.request.traj_id)

    def _claimable_blocks(self, seq: _Seq) -> int:
        cached = self.kv.cached_tokens(seq.request.traj_id) // BLOCK_TOKENS
        return min(cached, blocks_for(seq.num_tokens))

    def _admit(self, seq: _Seq) -> None:
        traj_id = seq.request.traj_id
        hit_tokens = min(self.kv.cached_tokens(traj_id), seq.num_tokens - 1)
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

    def _preempt(self, seq: _Seq) -> None:
        self._release(seq)
        seq.num_tokens = seq.request.context_tokens + seq.num_generated
        seq.kv_ready_tokens = 0
        self._waiting.appendleft(seq)

    def _release(self, seq: _Seq) -> None:
        """A sequence taken off the running batch (its counters true) frees its blocks."""
        self.kv.release(blocks_for(seq.num_tokens), seq.request.traj_id, seq.num_computed)
        seq.num_computed = 0

    # --- bookkeeping of the running batch --------------------------------------------

    def _start_decoding(self, seq: _Seq) -> None:
        """A running sequence with its counters true and its prompt computed decodes."""
        dec = self._dec
        seq.decoding = True
        seq.mark = dec
        seq.cls = (seq.num_tokens - dec) % BLOCK_TOKENS
        self._hist[seq.cls] += 1
        self._hist[seq.cls + BLOCK_TOKENS] += 1
        self._ctx += seq.num_tokens
        entry = (dec + seq.request.output_tokens - seq.num_generated, seq.order, seq)
        seq.entry = entry
        heapq.heappush(self._heap, entry)

    def _stop_decoding(self, seq: _Seq) -> None:
        """Make the counters of a decoding sequence true and take it off the aggregates."""
        delta = self._dec - seq.mark
        if delta:
            seq.num_tokens += delta
            seq.num_computed += delta
            seq.num_generated += delta
        seq.decoding = False
        seq.entry = None
        self._hist[seq.cls] -= 1
        self._hist[seq.cls + BLOCK_TOKENS] -= 1
        self._ctx -= seq.num_tokens

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

    def _remove_running(self, seq: _Seq) -> None:
        del self._running[seq]
        if seq.decoding:
            self._stop_decoding(seq)
        else:
            del self._prefilling[seq]

    # --- applying a step -------------------------------------------------------------

    def _finish(self, duration_s: float) -> tuple[Finished, ...]:
        """Retire the decoding sequences that generated their last token."""
        heap = self._heap
        dec = self._dec
        done: list[_Seq] = []
        while heap and heap[0][0] <= dec:
            entry = heapq.heappop(heap)
            if entry[2].entry is entry:
                done.append(entry[2])
        if not done:
            return ()
        if len(done) > 1:
            done.sort(key=_order)
        for seq in done:
            self._retire(seq)
        return tuple([Finished(seq.request, duration_s) for seq in done])

    def _advance_prefills(
        self, chunks: list[tuple[_Seq, int]], duration_s: float
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

    def _retire(self, seq: _Seq) -> None:
        del self._by_id[seq.request.request_id]
        self.num_requests -= 1
        if self.on_requests_changed is not None:
            self.on_requests_changed()
        self._remove_running(seq)
        self._release(seq)

    def _forget(self, seq: _Seq) -> PartialOutput:
        del self._by_id[seq.request.request_id]
        self.num_requests -= 1
        if self.on_requests_changed is not None:
            self.on_requests_changed()
        return PartialOutput(seq.request, seq.num_generated)

    def _take_waiting(self) -> tuple[PartialOutput, ...]:
        waiting, self._waiting = self._waiting, deque()
        return tuple(self._forget(s) for s in waiting)

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
        heap = self._heap
        while heap and heap[0][2].entry is not heap[0]:
            heapq.heappop(heap)  # a sequence that left
        if heap:
            num_steps = min(num_steps, heap[0][0] - self._dec)
        if num_steps <= 1:
            return 1
        if self._waiting and self._admissible(self._waiting[0]):
            return 1
        kv = self.kv
        available = kv.num_blocks - kv.num_held_blocks
        while num_steps > 1 and self._growth_blocks(num_steps) > available:
            num_steps //= 2
        return num_steps

    def _growth_blocks(self, num_steps: int) -> int:
        """Blocks the decoding sequences need for ``num_steps`` more tokens each.

        A sequence of ``t`` tokens has ``r = -t % BLOCK_TOKENS`` free slots in its last
        block, so ``q * BLOCK_TOKENS + k`` more tokens (``k < BLOCK_TOKENS``) open ``q``
        blocks, plus one when ``r < k``. Its ``cls`` is ``(t - _dec) % BLOCK_TOKENS``, so
        ``r < k`` for the classes ``-_dec - j`` (``j < k``): ``k`` classes in a row."""
        q, k = divmod(num_steps, BLOCK_TOKENS)
        total = q * (len(self._running) - len(self._prefilling)) if q else 0
        if k:
            first = (-self._dec - k + 1) % BLOCK_TOKENS
            total += sum(self._hist[first : first + k])
        return total

    def _decode_steps(self, num_steps: int, max_duration_s: float) -> EngineStepResult:
        batch = len(self._running)
        ctx = self._ctx
        decode = self.engine.decode
        b = float(batch)
        g = decode.small if b < decode.large_batch_from else decode.large
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


def _order(seq: _Seq) -> int:
    return seq.order
