"""A coarser model of one inference instance: one call runs until its batch loses a request.

``pearl.sim.engine.EngineModel`` (the *step* model) is the reference: vLLM v1's scheduler
step by step. The *fluid* model keeps its step times (``DecodeCoeffs``, ``PrefillCoeffs``),
its scheduling order (decode first, then prefill chunks first come first served under
``max_batched_tokens``, admission without overtaking when a prompt's KV blocks fit), its
KV blocks (growing as sequences decode, recompute preemption of the newest sequence when
they run out) and its prefix cache; what it changes is how much one call covers
(``docs/simulator.md``, "Engine models", has the comparison; a scenario picks one with
``engine_model``):

1. **One call, one run.** ``step()`` admits what fits, then runs prefill steps one by one
   (each decodes the running batch too) and, once no prompt is left to compute, every
   decode step up to the first request to finish, in closed form: ``n`` steps of a batch
   of ``B`` sequences holding ``K`` tokens take ``n * (base + per_seq * B + per_ctx * K) +
   per_ctx * B * n * (n - 1) / 2``. A prompt computed mid-run joins the decoding batch at
   the next step, as in the step model, within the same call. The step model returns
   after every prefill step and, when a request is due, at the last step end before it
   (and then runs one step more): the fluid model makes about two calls per turn (when
   the turn arrives, when it ends) where the step model makes about three.
2. **A bound is met at a step's end.** A run bounded at ``max_duration_s`` (the next
   request due, or the next control event) ends at the first step end at or after it: the
   request due is admitted when the step in flight ends, as in vLLM and at the same step
   end as in the step model.
3. **KV at run granularity.** A run stops at the last step whose growth the free blocks
   hold (evicting cached prefixes, least recently used first); when not even one step's
   fits, the newest running sequences are preempted until it does (the step model grows
   sequences oldest first and preempts the newest as each one runs out, within a step).
4. The times are floats summed in another order than the step model's: one request
   alone takes the step model's time to rounding, not bit for bit.

Roles as in the step model: a prefill instance ends a request when its prompt is computed
(a ``KvHandoff`` at that step's end, and the run returns there so that the KV leaves on
time); a decode instance is handed requests whose KV arrived (they skip the prefill).

The requests' bookkeeping, the views a router reads and the lazily advanced decoding
batch are the step model's (``pearl.sim.engine_base.EngineBase``, written once for both);
this module holds the fluid model's scheduling.

Invariants (``tests/sim/test_fluid_engine.py``, and ``tests/sim/test_engine_invariants.py``
for both models): held and cached KV never exceed the capacity; every submitted request
finishes (or hands off), waits (after a preemption too), or is returned by ``abort``,
``drain`` or ``abort_all`` with its partial output, exactly once; a run with work lasts
more than 0 s; the same calls give the same results, bit for bit.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from pearl.core.profile import EngineProfile
from pearl.core.roles import Role
from pearl.serving.requests import Request
from pearl.sim.engine import IDLE_STEP, EngineStepResult, Finished, KvHandoff
from pearl.sim.engine_base import EngineBase, Seq
from pearl.sim.kv_cache import BLOCK_TOKENS, blocks_for


@dataclass(slots=True, eq=False)
class _Req(Seq):
    """A request on this instance. While it decodes, only its ``num_generated`` advances
    lazily (``EngineBase``): ``num_tokens`` and ``num_computed`` stay its prompt's, and its
    context is ``_tokens(req)``."""

    in_prompt: int = 0  # of num_generated, those in num_tokens (recomputed after a preemption)
    admitted: bool = False


class FluidEngineModel(EngineBase[_Req]):
    """One engine instance as the fluid model runs it (the module docstring's rules).

    The running batch is kept as the prompts still prefilling (a queue, oldest first) and
    the decoding sequences (an insertion-ordered dict), which advance lazily through the
    decode-step counter ``_dec`` (``EngineBase``)."""

    def __init__(self, role: Role, engine: EngineProfile, kv_capacity_tokens: int) -> None:
        super().__init__(role, engine, kv_capacity_tokens)
        self._prefilling: deque[_Req] = deque()  # admitted, prompt partly computed
        self._decoding: dict[_Req, None] = {}  # oldest first

    # --- the running batch (EngineBase's hooks) --------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._decoding) + len(self._prefilling)

    def _new_seq(self, request: Request) -> _Req:
        return _Req(request, request.context_tokens, request.kv_ready_tokens)

    def _is_running(self, seq: _Req) -> bool:
        return seq.admitted

    def _running_oldest_first(self) -> list[_Req]:
        return sorted([*self._decoding, *self._prefilling], key=_order)

    def _leave(self, seq: _Req) -> None:
        """An admitted request leaves the running batch: its computed tokens stay cached."""
        if seq.decoding:
            self._stop_decoding(seq)
        else:
            self._prefilling.remove(seq)
        self._release(seq)

    # --- one run ---------------------------------------------------------------------

    def step(self, max_steps: int = 1, max_duration_s: float = math.inf) -> EngineStepResult:
        """Run up to the first request to finish (a prefill instance: the first prompt
        computed), to the first step end at or after ``max_duration_s``, to the last
        step whose KV growth fits, or ``max_steps`` steps; at least one step."""
        if not (self._decoding or self._prefilling or self._waiting):
            return IDLE_STEP
        self._queued = None
        if self._waiting:
            self._admit_waiting()
        kv = self.kv
        budget = self.engine.max_batched_tokens
        duration_s = 0.0
        steps = generated = prefilled = 0
        preempted: list[str] = []
        finished: tuple[Finished, ...] = ()
        handoffs: tuple[KvHandoff, ...] = ()
        while steps < max_steps:
            batch = len(self._decoding)
            # a step opens at most a block per sequence: the growth is counted only if short
            free = kv.num_blocks - kv.num_held_blocks
            if batch > free and self._growth_blocks(1) > free:
                self._preempt_for_one_step(preempted)
                batch = len(self._decoding)
            if self._prefilling and budget > batch:
                step_s, new = self._prefill_step(budget - batch)
                duration_s += step_s
                steps += 1
                generated += batch
                prefilled += new
                handoffs = self._prefills_done(duration_s)
            elif batch:
                n, step_s = self._decode_run(max_steps - steps, max_duration_s - duration_s)
                duration_s += step_s
                steps += n
                generated += batch * n
            else:
                break  # nothing admitted (the waiting need room that nothing here frees)
            if self._heap and self._heap[0][0] <= self._dec:
                finished = self._finish(duration_s)
                if finished:
                    break
            if handoffs or duration_s >= max_duration_s:
                break
        return EngineStepResult(
            duration_s,
            steps,
            len(self._decoding),
            prefilled,
            generated,
            finished,
            tuple(preempted),
            handoffs,
        )

    def _prefill_step(self, budget: int) -> tuple[float, int]:
        """One step: the decoding batch decodes a token, prompts get chunks first come
        first served. Its duration and the prompt tokens computed."""
        batch = len(self._decoding)
        step_s = 0.0
        if batch:
            step_s = self._decode_s(batch, 1)
            self._grow(1)
        new = quad = 0
        for req in self._prefilling:
            if budget <= 0:
                break
            p = req.num_computed
            chunk = min(req.num_tokens - p, budget)
            budget -= chunk
            e = p + chunk
            new += chunk
            quad += e * e - p * p
            req.num_computed = e
        prefill = self.engine.prefill
        step_s += prefill.a_s + prefill.b_s_per_token * new + prefill.c_s_per_token2 * quad
        return step_s, new

    def _prefills_done(self, at_s: float) -> tuple[KvHandoff, ...]:
        """Prompts computed in the last step start decoding at the next (a prefill
        instance hands them off)."""
        done: list[_Req] = []
        queue = self._prefilling
        while queue and queue[0].num_computed >= queue[0].num_tokens:
            done.append(queue.popleft())
        if self.role is not Role.PREFILL:
            for req in done:
                self._start_decoding(req)
            return ()
        for req in done:
            self._release(req)
            self._unbook(req)
        return tuple(KvHandoff(r.request, r.num_tokens, at_s) for r in done)

    def _decode_run(self, max_steps: int, bound_s: float) -> tuple[int, float]:
        """Decode steps with the batch unchanged: up to the first sequence to finish, the
        first step end at or after ``bound_s`` (at least one step), the last step whose
        growth fits the KV (one step's does), ``max_steps``."""
        finish_dec = self._next_finish_dec()
        assert finish_dec is not None, "the batch decodes"
        batch = len(self._decoding)
        n = min(finish_dec - self._dec, max_steps)
        duration_s = self._decode_s(batch, n)
        if n > 1 and duration_s > bound_s:  # the bound comes first: its step end
            n = self._steps_to(bound_s)
            duration_s = self._decode_s(batch, n)
        free = self._free_blocks()
        at_most = batch * -(-n // BLOCK_TOKENS)  # blocks n steps may open
        if n > 1 and at_most > free and self._growth_blocks(n) > free:
            n = self._steps_that_fit(n)
            duration_s = self._decode_s(batch, n)
        self._grow(n)
        return n, duration_s

    def _decode_s(self, batch: int, n: int) -> float:
        """``n`` decode steps of the batch from its context now (the context grows by the
        batch every step)."""
        g = self._regime(batch)
        first_s = g.base_s + g.per_seq_s * batch + g.per_ctx_token_s * self._ctx
        return n * first_s + g.per_ctx_token_s * batch * (n * (n - 1) // 2)

    def _steps_to(self, bound_s: float) -> int:
        """The fewest decode steps (>= 1) of the batch now that last ``bound_s`` or more."""
        if bound_s <= 0.0:
            return 1
        batch = len(self._decoding)
        g = self._regime(batch)
        c = g.base_s + g.per_seq_s * batch + g.per_ctx_token_s * self._ctx
        e = g.per_ctx_token_s * batch  # n steps last n c + e n (n - 1) / 2
        if e > 0.0:
            b = c - e / 2.0
            n = math.ceil((math.sqrt(b * b + 2.0 * e * bound_s) - b) / e)
        else:
            n = math.ceil(bound_s / c) if c > 0.0 else 1
        n = max(n, 1)
        while n > 1 and self._decode_s(batch, n - 1) >= bound_s:
            n -= 1
        while self._decode_s(batch, n) < bound_s:
            n += 1
        return n

    # --- KV blocks -------------------------------------------------------------------

    def _free_blocks(self) -> int:
        """Blocks that growth may take: free ones and cached prefixes (evicted LRU)."""
        return self.kv.num_blocks - self.kv.num_held_blocks

    def _steps_that_fit(self, n: int) -> int:
        """The most steps up to ``n`` whose growth the free blocks hold (one step's does)."""
        free = self._free_blocks()
        low, high = 1, n  # growth(low) fits, growth(high) does not
        while high - low > 1:
            mid = (low + high) // 2
            if self._growth_blocks(mid) <= free:
                low = mid
            else:
                high = mid
        return low

    def _grow(self, n: int) -> None:
        """The decoding sequences decode ``n`` tokens each (their blocks were checked)."""
        grown = self.kv.allocate(self._growth_blocks(n))  # evicts cached prefixes, LRU first
        assert grown, "growth blocks were checked"
        self._dec += n
        self._ctx += len(self._decoding) * n

    def _preempt_for_one_step(self, preempted: list[str]) -> None:
        """The newest running sequences go back to the head of the queue, their blocks
        freed (their computed full blocks stay cached), until one step's growth fits."""
        running = self._running_oldest_first()
        while self._decoding and self._growth_blocks(1) > self._free_blocks():
            req = running.pop()
            self._leave(req)
            req.num_tokens = req.request.context_tokens + req.num_generated
            req.in_prompt = req.num_generated
            req.num_computed = req.kv_ready_tokens = 0
            self._waiting.appendleft(req)
            preempted.append(req.request.request_id)

    # --- admission, finishing --------------------------------------------------------

    def _admit_waiting(self) -> None:
        """First come first served while a sequence slot and the KV of the prompt are free
        (evicting others' cached prefixes), no overtaking."""
        max_seqs = self.engine.max_num_seqs
        kv = self.kv
        while self._waiting and len(self._decoding) + len(self._prefilling) < max_seqs:
            req = self._waiting[0]
            traj_id = req.request.traj_id
            blocks = blocks_for(req.num_tokens)
            claimable = min(kv.cached_tokens(traj_id) // BLOCK_TOKENS, blocks)
            if not kv.can_hold(blocks - claimable, traj_id):
                return
            self._waiting.popleft()
            hit = self._hit_tokens(req)
            claimed = kv.claim(traj_id, blocks)
            allocated = kv.allocate(blocks - claimed)
            assert allocated, "admission checked the blocks"
            req.admitted = True
            req.num_computed = max(hit, min(req.kv_ready_tokens, req.num_tokens))
            self._order += 1
            req.order = self._order
            if req.num_computed < req.num_tokens:
                self._prefilling.append(req)
            else:
                self._start_decoding(req)

    def _start_decoding(self, req: _Req) -> None:
        self._decoding[req] = None
        self._join_decoding(req, _tokens(req))

    def _stop_decoding(self, req: _Req) -> None:
        req.num_generated += self._dec - req.mark
        del self._decoding[req]
        self._leave_decoding(req, _tokens(req))

    def _finish(self, at_s: float) -> tuple[Finished, ...]:
        done = self._due()
        for req in done:
            self._retire(req)
        return tuple([Finished(req.request, at_s) for req in done])

    def _release(self, req: _Req) -> None:
        """Free the blocks of a request off the running batch (its counters true)."""
        decoded = req.num_generated - req.in_prompt  # computed too, beyond the prompt
        held = blocks_for(req.num_tokens + decoded)
        self.kv.release(held, req.request.traj_id, req.num_computed + decoded)
        req.admitted = False


def _order(req: _Req) -> int:
    return req.order


def _tokens(req: _Req) -> int:
    """Tokens in a request's context now (its counters true): prompt and decoded."""
    return req.num_tokens + req.num_generated - req.in_prompt
