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

Invariants (``tests/sim/test_fluid_engine.py``): held and cached KV never exceed the
capacity; every submitted request finishes (or hands off), waits (after a preemption
too), or is returned by ``abort``, ``drain`` or ``abort_all`` with its partial output,
exactly once; a run with work lasts more than 0 s; the same calls give the same results,
bit for bit.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pearl.core.profile import DecodeRegime, EngineProfile, RuntimeProfile
from pearl.core.roles import INFERENCE_ROLES, Role
from pearl.serving.requests import PartialOutput, Request
from pearl.sim.engine import IDLE_STEP, EngineStepResult, Finished, KvHandoff
from pearl.sim.kv_cache import BLOCK_TOKENS, KvCache, blocks_for


@dataclass(slots=True, eq=False)
class _Req:
    """A request on this instance. While it decodes, its generated count is kept lazily:
    the true count is ``generated + FluidEngineModel._dec - mark``."""

    request: Request
    num_tokens: int  # its prompt: the context to compute (with the output of a preemption)
    kv_ready_tokens: int  # KV that arrived from a prefill instance (0 after a preemption)
    num_computed: int = 0  # prompt tokens whose KV is held
    generated: int = 0  # output tokens generated so far (on this instance)
    in_prompt: int = 0  # of them, those in num_tokens (recomputed after a preemption)
    admitted: bool = False
    order: int = 0  # admission order
    decoding: bool = False
    mark: int = 0
    cls: int = 0  # (tokens - mark) % BLOCK_TOKENS while decoding
    entry: tuple[int, int, _Req] | None = None  # its live entry in the finish heap


class FluidEngineModel:
    """One engine instance as the fluid model runs it (the module docstring's rules).

    Decoding sequences advance lazily (``_Req``); their context summed, a histogram of
    their token counts modulo the block size (for the blocks ``n`` more tokens open) and a
    heap of the ``_dec`` at which each finishes are kept up to date."""

    def __init__(self, role: Role, engine: EngineProfile, kv_capacity_tokens: int) -> None:
        if role not in INFERENCE_ROLES:
            raise ValueError(f"role: {role} is not an inference role")
        self.role = role
        self.engine = engine
        self.kv = KvCache(kv_capacity_tokens)
        self._waiting: deque[_Req] = deque()
        self._prefilling: deque[_Req] = deque()  # admitted, prompt partly computed
        self._decoding: dict[_Req, None] = {}  # oldest first
        self._by_id: dict[str, _Req] = {}
        self.num_requests = 0  # running and waiting
        self.on_requests_changed: Callable[[], None] | None = None  # after each change
        self._accepting = True
        self._dec = 0  # decode steps run by the decoding batch (lazy counters)
        self._ctx = 0  # tokens in KV of the decoding batch, summed
        self._hist = [0] * (2 * BLOCK_TOKENS)  # decoding per _Req.cls, twice over
        self._heap: list[tuple[int, int, _Req]] = []  # (finish at _dec, order, req)
        self._order = 0
        self._queued: tuple[int, int] | None = None  # queued_prefill() until a change

    @classmethod
    def from_profile(
        cls, role: Role, profile: RuntimeProfile, gpu_type: str, tp: int
    ) -> FluidEngineModel:
        engine = profile.engine(gpu_type, tp)
        if engine is None:
            raise ValueError(f"profile has no engine for {gpu_type} tp={tp}")
        return cls(role, engine, profile.kv_capacity_tokens(gpu_type, tp))

    # --- what a router and the simulator read ----------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._decoding or self._prefilling or self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._decoding) + len(self._prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_decoding(self) -> int:
        return len(self._decoding)

    @property
    def decoding_context_tokens(self) -> int:
        return self._ctx

    @property
    def kv_used_tokens(self) -> int:
        return (self.kv.num_held_blocks + self.kv.num_cached_blocks) * BLOCK_TOKENS

    def queued_prefill(self) -> tuple[int, int]:
        """As ``EngineModel.queued_prefill``: the prompt tokens still to compute ahead of a
        new request, and their attention's token pairs."""
        if self._queued is not None:
            return self._queued
        tokens = pairs = 0
        for req in self._prefilling:
            p, e = req.num_computed, req.num_tokens
            tokens += e - p
            pairs += e * e - p * p
        for req in self._waiting:
            e = req.num_tokens
            p = max(self._hit(req), min(req.kv_ready_tokens, e))
            tokens += e - p
            pairs += e * e - p * p
        self._queued = (tokens, pairs)
        return self._queued

    def num_generated(self, request_id: str) -> int:
        req = self._by_id[request_id]
        return req.generated + (self._dec - req.mark if req.decoding else 0)

    def cached_tokens(self, traj_id: str) -> int:
        return self.kv.cached_tokens(traj_id)

    def request_ids(self) -> set[str]:
        return set(self._by_id)

    def generated_by_request(self) -> list[tuple[Request, int]]:
        return [(req.request, self.num_generated(rid)) for rid, req in self._by_id.items()]

    # --- requests in and out ---------------------------------------------------------

    def submit(self, request: Request) -> None:
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
        req = _Req(request, request.context_tokens, request.kv_ready_tokens)
        self._waiting.append(req)
        self._by_id[request.request_id] = req
        self._changed()

    def abort(self, request_id: str) -> PartialOutput | None:
        req = self._by_id.get(request_id)
        if req is None:
            return None
        if req.admitted:
            self._leave(req)
        else:
            self._waiting.remove(req)
        return self._forget(req)

    def drain(self) -> tuple[PartialOutput, ...]:
        """Stop accepting requests and hand back the waiting ones; admitted ones finish."""
        self._accepting = False
        return self._take_waiting()

    def abort_all(self) -> tuple[PartialOutput, ...]:
        """Take every request off: admitted ones first, oldest first, then the waiting."""
        admitted = sorted([*self._decoding, *self._prefilling], key=_order)
        for req in admitted:
            self._leave(req)
        return tuple(self._forget(r) for r in admitted) + self._take_waiting()

    def resume(self) -> None:
        self._accepting = True

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
            if batch > free and self._growth(1) > free:
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
            self._retire(req)
        return tuple(KvHandoff(r.request, r.num_tokens, at_s) for r in done)

    def _decode_run(self, max_steps: int, bound_s: float) -> tuple[int, float]:
        """Decode steps with the batch unchanged: up to the first sequence to finish, the
        first step end at or after ``bound_s`` (at least one step), the last step whose
        growth fits the KV (one step's does), ``max_steps``."""
        heap = self._heap
        while heap[0][2].entry is not heap[0]:
            heapq.heappop(heap)  # a sequence that left
        batch = len(self._decoding)
        n = min(heap[0][0] - self._dec, max_steps)
        duration_s = self._decode_s(batch, n)
        if n > 1 and duration_s > bound_s:  # the bound comes first: its step end
            n = self._steps_to(bound_s)
            duration_s = self._decode_s(batch, n)
        free = self._free_blocks()
        at_most = batch * -(-n // BLOCK_TOKENS)  # blocks n steps may open
        if n > 1 and at_most > free and self._growth(n) > free:
            n = self._steps_that_fit(n)
            duration_s = self._decode_s(batch, n)
        self._grow(n)
        return n, duration_s

    def _regime(self, batch: int) -> DecodeRegime:
        decode = self.engine.decode
        return decode.small if batch < decode.large_batch_from else decode.large

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

    def _growth(self, n: int) -> int:
        """Blocks the decoding sequences need for ``n`` more tokens each: a sequence of
        ``t`` tokens has ``-t % BLOCK_TOKENS`` free slots in its last block, so ``q *
        BLOCK_TOKENS + k`` more tokens (``k < BLOCK_TOKENS``) open ``q`` blocks, and one more
        for the ``k`` classes ``cls = -_dec - j`` (``j < k``) in a row."""
        q, k = divmod(n, BLOCK_TOKENS)
        total = q * len(self._decoding)
        if k:
            first = (-self._dec - k + 1) % BLOCK_TOKENS
            total += sum(self._hist[first : first + k])
        return total

    def _steps_that_fit(self, n: int) -> int:
        """The most steps up to ``n`` whose growth the free blocks hold (one step's does)."""
        free = self._free_blocks()
        low, high = 1, n  # growth(low) fits, growth(high) does not
        while high - low > 1:
            mid = (low + high) // 2
            if self._growth(mid) <= free:
                low = mid
            else:
                high = mid
        return low

    def _grow(self, n: int) -> None:
        """The decoding sequences decode ``n`` tokens each (their blocks were checked)."""
        grown = self.kv.allocate(self._growth(n))  # evicts cached prefixes, LRU first
        assert grown, "growth blocks were checked"
        self._dec += n
        self._ctx += len(self._decoding) * n

    def _preempt_for_one_step(self, preempted: list[str]) -> None:
        """The newest running sequences go back to the head of the queue, their blocks
        freed (their computed full blocks stay cached), until one step's growth fits."""
        running = sorted([*self._decoding, *self._prefilling], key=_order)
        while self._decoding and self._growth(1) > self._free_blocks():
            req = running.pop()
            self._leave(req)
            req.num_tokens = req.request.context_tokens + req.generated
            req.in_prompt = req.generated
            req.num_computed = req.kv_ready_tokens = 0
            self._waiting.appendleft(req)
            preempted.append(req.request.request_id)

    # --- admission, finishing --------------------------------------------------------

    def _hit(self, req: _Req) -> int:
        return min(self.kv.cached_tokens(req.request.traj_id), req.num_tokens - 1)

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
            hit = self._hit(req)
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
        dec = self._dec
        tokens = _tokens(req)
        req.decoding = True
        req.mark = dec
        req.cls = (tokens - dec) % BLOCK_TOKENS
        self._hist[req.cls] += 1
        self._hist[req.cls + BLOCK_TOKENS] += 1
        self._decoding[req] = None
        self._ctx += tokens
        entry = (dec + req.request.output_tokens - req.generated, req.order, req)
        req.entry = entry
        heapq.heappush(self._heap, entry)

    def _stop_decoding(self, req: _Req) -> None:
        req.generated += self._dec - req.mark
        req.decoding = False
        req.entry = None
        self._hist[req.cls] -= 1
        self._hist[req.cls + BLOCK_TOKENS] -= 1
        del self._decoding[req]
        self._ctx -= _tokens(req)

    def _finish(self, at_s: float) -> tuple[Finished, ...]:
        heap = self._heap
        done: list[_Req] = []
        while heap and heap[0][0] <= self._dec:
            entry = heapq.heappop(heap)
            if entry[2].entry is entry:
                done.append(entry[2])
        if not done:
            return ()
        if len(done) > 1:
            done.sort(key=_order)
        for req in done:
            self._stop_decoding(req)
            self._release(req)
            self._retire(req)
        return tuple([Finished(req.request, at_s) for req in done])

    def _leave(self, req: _Req) -> None:
        """An admitted request leaves the running batch: its computed tokens stay cached."""
        if req.decoding:
            self._stop_decoding(req)
        else:
            self._prefilling.remove(req)
        self._release(req)

    def _release(self, req: _Req) -> None:
        """Free the blocks of a request off the running batch (its counters true)."""
        decoded = req.generated - req.in_prompt  # computed too, beyond the prompt
        held = blocks_for(req.num_tokens + decoded)
        self.kv.release(held, req.request.traj_id, req.num_computed + decoded)
        req.admitted = False

    def _retire(self, req: _Req) -> None:
        del self._by_id[req.request.request_id]
        self._changed()

    def _forget(self, req: _Req) -> PartialOutput:
        del self._by_id[req.request.request_id]
        self._changed()
        return PartialOutput(req.request, req.generated)

    def _take_waiting(self) -> tuple[PartialOutput, ...]:
        waiting, self._waiting = self._waiting, deque()
        return tuple(self._forget(r) for r in waiting)

    def _changed(self) -> None:
        self.num_requests = len(self._by_id)
        self._queued = None
        if self.on_requests_changed is not None:
            self.on_requests_changed()


def _order(req: _Req) -> int:
    return req.order


def _tokens(req: _Req) -> int:
    """Tokens in a request's context now (its counters true): prompt and decoded."""
    return req.num_tokens + req.generated - req.in_prompt
