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

``step(max_steps=k)`` may run up to ``k`` decode steps at once when nothing can change
the batch in between (every running sequence decoding, no admission possible, blocks for
the growth available): the same outcome as ``k`` single steps, in one call of O(batch).

Invariants (asserted by ``tests/sim/test_engine.py``):
- held and cached KV never exceed ``kv_capacity_tokens`` (rounded down to blocks);
- every submitted request finishes (or hands off), is queued (after a preemption too),
  or is returned with its partial output by ``abort``, ``drain`` or ``abort_all``: none
  disappears and none is reported twice;
- a step with work lasts more than 0 s; an idle engine's step lasts 0 s and reports nothing;
- the same calls give the same results, bit for bit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from pearl.core.profile import EngineProfile, RuntimeProfile
from pearl.core.roles import INFERENCE_ROLES, Role
from pearl.sim.kv_cache import BLOCK_TOKENS, KvCache, blocks_for


@dataclass(frozen=True, slots=True)
class Request:
    """One turn of one trajectory sent to an instance."""

    request_id: str
    traj_id: str
    context_tokens: int  # the whole prompt of this turn
    output_tokens: int  # tokens to generate (ignored by prefill instances)
    kv_ready_tokens: int = 0  # prompt tokens whose KV arrived from a prefill instance


@dataclass(frozen=True, slots=True)
class PartialOutput:
    """A request taken off an instance, with the tokens it generated there so far."""

    request: Request
    num_generated_tokens: int

    def continuation(self, request_id: str) -> Request:
        """The rest of the turn as a new request (its output so far joins the prompt)."""
        r = self.request
        return Request(
            request_id,
            r.traj_id,
            r.context_tokens + self.num_generated_tokens,
            r.output_tokens - self.num_generated_tokens,
        )


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
class StepResult:
    duration_s: float
    num_steps: int  # scheduler steps this result covers (0 when idle)
    num_decode_seqs: int  # sequences decoded per step
    num_prefill_tokens: int
    num_generated_tokens: int
    finished: tuple[Finished, ...] = ()
    preempted: tuple[str, ...] = ()  # request ids re-queued for recomputation
    handoffs: tuple[KvHandoff, ...] = ()


IDLE_STEP = StepResult(0.0, 0, 0, 0, 0)


@dataclass(slots=True, eq=False)
class _Seq:
    request: Request
    num_tokens: int  # prompt to compute: context plus tokens generated before a preemption
    num_generated: int = 0
    num_computed: int = 0  # tokens whose KV is held
    num_blocks: int = 0
    kv_ready_tokens: int = field(default=0)

    @property
    def remaining_tokens(self) -> int:
        return self.request.output_tokens - self.num_generated


def kv_transfer_s(
    tokens: int, profile: RuntimeProfile, gpu_type: str, same_node: bool, tp: int = 1
) -> float:
    """Time to move the KV of ``tokens`` tokens between instances of ``tp`` GPUs each
    (the narrower side's), over NVLink within a node or the network between nodes."""
    gpu = profile.gpus[gpu_type]
    gb_per_s = gpu.kv_transfer_intra_node_gb_per_s if same_node else gpu.kv_transfer_gb_per_s
    return tokens * profile.model.kv_bytes_per_token / (tp * gb_per_s * 1e9)


class EngineModel:
    """One engine instance: queue, running batch and KV cache; ``step()`` advances it."""

    def __init__(self, role: Role, engine: EngineProfile, kv_capacity_tokens: int) -> None:
        if role not in INFERENCE_ROLES:
            raise ValueError(f"role: {role} is not an inference role")
        self.role = role
        self.engine = engine
        self.kv = KvCache(kv_capacity_tokens)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}
        self._accepting = True

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

    def num_generated(self, request_id: str) -> int:
        return self._by_id[request_id].num_generated

    def cached_tokens(self, traj_id: str) -> int:
        return self.kv.cached_tokens(traj_id)

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
        self._waiting.append(seq)
        self._by_id[request.request_id] = seq

    def abort(self, request_id: str) -> PartialOutput | None:
        """Take one request off, wherever it is; None if it is not here."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        if seq in self._waiting:
            self._waiting.remove(seq)
        else:
            self._running.remove(seq)
            self._release(seq)
        return self._forget(seq)

    def drain(self) -> tuple[PartialOutput, ...]:
        """Stop accepting requests and hand back the queued ones; running ones finish
        (a sequence preempted while draining is recomputed here, not handed back)."""
        self._accepting = False
        return self._take_waiting()

    def abort_all(self) -> tuple[PartialOutput, ...]:
        """Take every request off (running first, oldest first), e.g. before a switch."""
        running, self._running = self._running, []
        for seq in running:
            self._release(seq)
        return tuple(self._forget(s) for s in running) + self._take_waiting()

    def resume(self) -> None:
        """Accept requests again after ``drain`` (a drain that was cancelled)."""
        self._accepting = True

    # --- one step --------------------------------------------------------------------

    def step(self, max_steps: int = 1, max_duration_s: float = math.inf) -> StepResult:
        """Run one scheduler step, or up to ``max_steps`` identical decode steps that end
        within ``max_duration_s`` (at least one step is always run)."""
        if not self.has_work:
            return IDLE_STEP
        if max_steps > 1:
            num_steps = self._stable_decode_steps(max_steps)
            if num_steps > 1:
                return self._decode_steps(num_steps, max_duration_s)
        return self._single_step()

    def _single_step(self) -> StepResult:
        preempted: list[str] = []
        budget = self.engine.max_batched_tokens
        self._admit_kv_ready()
        decoding = self._schedule_decodes(budget, preempted)
        chunks = self._schedule_prefills(budget - len(decoding))
        duration_s = 0.0
        if decoding:
            ctx = sum(s.num_tokens for s in decoding)
            duration_s += float(self.engine.decode.step_s(len(decoding), ctx))
        if chunks:
            new = [n for _, n in chunks]
            prefix = [s.num_computed for s, _ in chunks]
            duration_s += self.engine.prefill.batch_s(new, prefix)
        finished = self._advance_decodes(decoding, 1, duration_s)
        handoffs = self._advance_prefills(chunks, duration_s)
        return StepResult(
            duration_s,
            1,
            len(decoding),
            sum(n for _, n in chunks),
            len(decoding),
            finished,
            tuple(preempted),
            handoffs,
        )

    # --- scheduling ------------------------------------------------------------------

    def _schedule_decodes(self, budget: int, preempted: list[str]) -> list[_Seq]:
        fast = self._decode_all_fast(budget)
        if fast is not None:
            return fast
        decoding: list[_Seq] = []
        i = 0
        while i < len(self._running) and len(decoding) < budget:
            seq = self._running[i]
            i += 1
            if seq.num_computed < seq.num_tokens:
                continue  # still prefilling
            if not self._grow(seq, 1, preempted):
                break  # it preempted itself: everything after it is gone too
            decoding.append(seq)
        return decoding

    def _decode_all_fast(self, budget: int) -> list[_Seq] | None:
        """Every running sequence decodes and the KV has room for all of them: the same
        outcome as growing them one by one, without the per-sequence allocation calls.
        None when the general path is needed (a prefill in the batch, or KV pressure)."""
        running = self._running
        if len(running) > budget:
            return None
        need = 0
        for seq in running:
            if seq.num_computed < seq.num_tokens:
                return None
            need += -(-(seq.num_tokens + 1) // BLOCK_TOKENS) - seq.num_blocks
        if need > self.kv.num_free_blocks:
            return None
        self.kv.num_held_blocks += need
        for seq in running:
            seq.num_blocks = -(-(seq.num_tokens + 1) // BLOCK_TOKENS)
        return list(running)

    def _grow(self, seq: _Seq, num_steps: int, preempted: list[str]) -> bool:
        need = blocks_for(seq.num_tokens + num_steps) - seq.num_blocks
        while need > 0 and not self.kv.allocate(need):
            victim = self._running.pop()
            self._preempt(victim)
            preempted.append(victim.request.request_id)
            if victim is seq:
                return False
        seq.num_blocks += max(need, 0)
        return True

    def _schedule_prefills(self, budget: int) -> list[tuple[_Seq, int]]:
        chunks: list[tuple[_Seq, int]] = []
        for seq in self._running:
            if budget <= 0:
                return chunks
            if seq.num_computed < seq.num_tokens:
                chunk = min(seq.num_tokens - seq.num_computed, budget)
                chunks.append((seq, chunk))
                budget -= chunk
        while budget > 0 and self._waiting and self._admissible(self._waiting[0]):
            seq = self._waiting.popleft()
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
        seq.num_blocks = total
        seq.num_computed = max(hit_tokens, min(seq.kv_ready_tokens, seq.num_tokens))
        self._running.append(seq)

    def _preempt(self, seq: _Seq) -> None:
        self._release(seq)
        seq.num_tokens = seq.request.context_tokens + seq.num_generated
        seq.kv_ready_tokens = 0
        self._waiting.appendleft(seq)

    def _release(self, seq: _Seq) -> None:
        self.kv.release(seq.num_blocks, seq.request.traj_id, seq.num_computed)
        seq.num_blocks = 0
        seq.num_computed = 0

    # --- applying a step -------------------------------------------------------------

    def _advance_decodes(
        self, decoding: list[_Seq], num_steps: int, duration_s: float
    ) -> tuple[Finished, ...]:
        finished: list[Finished] = []
        for seq in decoding:
            seq.num_tokens += num_steps
            seq.num_computed += num_steps
            seq.num_generated += num_steps
            if seq.num_generated >= seq.request.output_tokens:
                finished.append(Finished(seq.request, duration_s))
        self._retire(f.request.request_id for f in finished)
        return tuple(finished)

    def _advance_prefills(
        self, chunks: list[tuple[_Seq, int]], duration_s: float
    ) -> tuple[KvHandoff, ...]:
        for seq, chunk in chunks:
            seq.num_computed += chunk
        if self.role is not Role.PREFILL:
            return ()
        done = [s for s, _ in chunks if s.num_computed >= s.num_tokens]
        self._retire(s.request.request_id for s in done)
        return tuple(KvHandoff(s.request, s.num_tokens, duration_s) for s in done)

    def _retire(self, request_ids: Iterable[str]) -> None:
        gone = [self._by_id.pop(r) for r in request_ids]
        if not gone:
            return
        for seq in gone:
            self._release(seq)
        self._running = [s for s in self._running if s.request.request_id in self._by_id]

    def _forget(self, seq: _Seq) -> PartialOutput:
        del self._by_id[seq.request.request_id]
        return PartialOutput(seq.request, seq.num_generated)

    def _take_waiting(self) -> tuple[PartialOutput, ...]:
        waiting, self._waiting = self._waiting, deque()
        return tuple(self._forget(s) for s in waiting)

    # --- several decode steps at once ------------------------------------------------

    def _stable_decode_steps(self, max_steps: int) -> int:
        """How many decode steps can run with the batch unchanged (1 if not several)."""
        running = self._running
        if self.role is Role.PREFILL or len(running) > self.engine.max_batched_tokens:
            return 1
        num_steps = max_steps
        for s in running:
            if s.num_computed < s.num_tokens:
                return 1
            num_steps = min(num_steps, s.request.output_tokens - s.num_generated)
        if self._waiting and self._admissible(self._waiting[0]):
            return 1
        available = self.kv.num_free_blocks + self.kv.num_cached_blocks
        while num_steps > 1 and self._growth_blocks(num_steps) > available:
            num_steps //= 2
        return num_steps

    def _growth_blocks(self, num_steps: int) -> int:
        return sum(blocks_for(s.num_tokens + num_steps) - s.num_blocks for s in self._running)

    def _decode_steps(self, num_steps: int, max_duration_s: float) -> StepResult:
        batch = len(self._running)
        ctx = sum(s.num_tokens for s in self._running)
        times_s = self.engine.decode.step_s(batch, ctx + batch * np.arange(num_steps))
        ends_s = np.cumsum(times_s)
        num_steps = max(1, min(num_steps, int(np.searchsorted(ends_s, max_duration_s, "right"))))
        duration_s = float(ends_s[num_steps - 1])
        growth = 0
        for seq in self._running:
            blocks = -(-(seq.num_tokens + num_steps) // BLOCK_TOKENS)
            growth += blocks - seq.num_blocks
            seq.num_blocks = blocks
        grown = self.kv.allocate(growth)  # evicts cached prefixes as one-by-one growth would
        assert grown, "growth blocks were checked"
        decoding = list(self._running)
        finished = self._advance_decodes(decoding, num_steps, duration_s)
        return StepResult(duration_s, num_steps, batch, 0, batch * num_steps, finished)
