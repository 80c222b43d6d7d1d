"""What both engine models keep of one instance's requests, written once.

The step model (``pearl.sim.engine.EngineModel``) and the fluid model
(``pearl.sim.fluid_engine.FluidEngineModel``) schedule differently but hold their
requests alike; ``EngineBase`` is that common part, and each model subclasses it with its
running batch and its ``step()``:

- **Requests in and out.** ``submit`` checks a request and queues it; ``abort``,
  ``drain``, ``abort_all`` and ``resume`` take requests off (``PartialOutput``: the request
  and the tokens it generated here) or accept them again. Every request is on the books
  (``_by_id``) from ``submit`` until it finishes or hands its KV off (``_retire``) or is
  handed back (``_forget``); ``num_requests`` counts them and ``on_requests_changed`` is
  called after each change.
- **What a router and the simulator read** (``pearl.serving.views``): ``has_work``,
  ``num_waiting``, ``num_decoding``, ``decoding_context_tokens``, ``kv_used_tokens``,
  ``queued_prefill()`` (kept until something changes it), ``num_generated``,
  ``cached_tokens``, ``request_ids``, ``generated_by_request``.
- **The decoding batch, advanced lazily.** Every decoding sequence decodes one token per
  decode step, so a decode step only counts ``_dec``: a decoding sequence's true
  ``num_generated`` is the stored one plus ``_dec - mark``. Its context summed
  (``_ctx``), a histogram of the token counts modulo the block size (``_hist``, for the
  blocks ``n`` more tokens open: ``_growth_blocks``) and a heap of the ``_dec`` at which
  each sequence finishes (``_heap``, popped by ``_due``) are kept by ``_join_decoding``
  and ``_leave_decoding``; ``_regime`` picks the decode step's coefficients.

A model supplies ``_prefilling`` (its running sequences whose prompt is partly
computed, oldest first), ``num_running`` and the hooks ``_new_seq`` (its ``Seq``),
``_is_running``, ``_running_oldest_first`` and ``_leave`` (a running sequence leaves the
batch, its counters made true and its blocks released). Nothing here reads a clock,
draws a random number or does I/O.

Invariants (``tests/sim/test_engine_invariants.py`` and each model's tests): a request
is on the books exactly once until it is reported, by a step or by ``abort``, ``drain``
or ``abort_all``; ``num_requests == len(_by_id)``; the histogram's first half counts the
decoding sequences (``num_decoding``) and ``_ctx`` sums their true context.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Generic, Self, TypeVar

from pearl.core.profile import DecodeRegime, EngineProfile, RuntimeProfile
from pearl.core.roles import INFERENCE_ROLES, Role
from pearl.serving.requests import PartialOutput, Request
from pearl.sim.kv_cache import BLOCK_TOKENS, KvCache, blocks_for


@dataclass(slots=True, eq=False)
class Seq:
    """A request on an instance. While it decodes (``decoding``), its ``num_generated`` is
    kept lazily (``EngineBase``); which other counters advance with it is the model's."""

    request: Request
    num_tokens: int  # the prompt to compute: context and any output before a preemption
    kv_ready_tokens: int  # KV that arrived from a prefill instance (0 after a preemption)
    num_computed: int = 0  # tokens whose KV is held
    num_generated: int = 0  # output tokens generated on this instance
    decoding: bool = False  # running with its prompt computed: counters are lazy
    mark: int = 0  # EngineBase._dec when the stored counters were true
    order: int = 0  # admission order (the running batch's order)
    cls: int = 0  # (context tokens - mark) % BLOCK_TOKENS while decoding
    entry: tuple[int, int, Seq] | None = None  # its live entry in the finish heap


S = TypeVar("S", bound=Seq)


class EngineBase(ABC, Generic[S]):
    """One instance's requests, queue, KV cache and decoding batch (the module docstring)."""

    _prefilling: Collection[S]  # running, prompt partly computed, oldest first (the model's)

    def __init__(self, role: Role, engine: EngineProfile, kv_capacity_tokens: int) -> None:
        if role not in INFERENCE_ROLES:
            raise ValueError(f"role: {role} is not an inference role")
        self.role = role
        self.engine = engine
        self.kv = KvCache(kv_capacity_tokens)
        self._waiting: deque[S] = deque()
        self._by_id: dict[str, S] = {}
        self.num_requests = 0  # running and waiting: len(self._by_id), read per route
        # called after every change of num_requests (a router's index of loads)
        self.on_requests_changed: Callable[[], None] | None = None
        self._accepting = True
        self._dec = 0  # decode steps run by the decoding sequences, lazily applied
        self._ctx = 0  # true context tokens summed over the decoding sequences
        # decoding sequences per Seq.cls, twice over (a rotation is a contiguous slice)
        self._hist = [0] * (2 * BLOCK_TOKENS)
        self._heap: list[tuple[int, int, S]] = []  # (finish at _dec, order, seq)
        self._order = 0  # admissions so far
        self._queued: tuple[int, int] | None = None  # queued_prefill() until a change

    @classmethod
    def from_profile(cls, role: Role, profile: RuntimeProfile, gpu_type: str, tp: int) -> Self:
        engine = profile.engine(gpu_type, tp)
        if engine is None:
            raise ValueError(f"profile has no engine for {gpu_type} tp={tp}")
        return cls(role, engine, profile.kv_capacity_tokens(gpu_type, tp))

    # --- the model's running batch ---------------------------------------------------

    @property
    @abstractmethod
    def num_running(self) -> int:
        """Sequences admitted to the running batch (prefilling or decoding)."""

    @abstractmethod
    def _new_seq(self, request: Request) -> S:
        """The model's sequence of a request just submitted."""

    @abstractmethod
    def _is_running(self, seq: S) -> bool:
        """Whether a sequence on the books is in the running batch (else it waits)."""

    @abstractmethod
    def _running_oldest_first(self) -> list[S]:
        """The running sequences in admission order."""

    @abstractmethod
    def _leave(self, seq: S) -> None:
        """A running sequence leaves the batch: its counters made true, its blocks
        released (its computed full blocks stay cached for its trajectory)."""

    # --- what a router and the simulator read ----------------------------------------

    @property
    def has_work(self) -> bool:
        """Whether any request is here (every one on the books runs or waits)."""
        return bool(self._by_id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_decoding(self) -> int:
        """Running sequences whose prompt is computed (each decodes a token per step)."""
        return self.num_running - len(self._prefilling)

    @property
    def decoding_context_tokens(self) -> int:
        """Tokens in KV of the decoding sequences, summed."""
        return self._ctx

    @property
    def kv_used_tokens(self) -> int:
        """Tokens' worth of blocks held or cached (block granularity)."""
        return (self.kv.num_held_blocks + self.kv.num_cached_blocks) * BLOCK_TOKENS

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
            p = max(self._hit_tokens(seq), min(seq.kv_ready_tokens, e))
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
        seq = self._new_seq(request)
        self._waiting.append(seq)
        self._by_id[request.request_id] = seq
        self._books_changed()

    def abort(self, request_id: str) -> PartialOutput | None:
        """Take one request off, wherever it is; None if it is not here."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        if self._is_running(seq):
            self._leave(seq)
        else:
            self._waiting.remove(seq)
        return self._forget(seq)

    def drain(self) -> tuple[PartialOutput, ...]:
        """Stop accepting requests and hand back the queued ones; running ones finish
        (a sequence preempted while draining is recomputed here, not handed back)."""
        self._accepting = False
        return self._take_waiting()

    def abort_all(self) -> tuple[PartialOutput, ...]:
        """Take every request off (running first, oldest first), e.g. before a switch."""
        running = self._running_oldest_first()
        for seq in running:
            self._leave(seq)
        return tuple(self._forget(s) for s in running) + self._take_waiting()

    def resume(self) -> None:
        """Accept requests again after ``drain`` (a drain that was cancelled)."""
        self._accepting = True

    def _retire(self, seq: S) -> None:
        """A running request is done here (finished, or its KV handed off)."""
        self._leave(seq)
        self._unbook(seq)

    def _forget(self, seq: S) -> PartialOutput:
        """A request off the running batch and the queue is handed back."""
        self._unbook(seq)
        return PartialOutput(seq.request, seq.num_generated)

    def _take_waiting(self) -> tuple[PartialOutput, ...]:
        waiting, self._waiting = self._waiting, deque()
        return tuple(self._forget(s) for s in waiting)

    def _unbook(self, seq: S) -> None:
        del self._by_id[seq.request.request_id]
        self._books_changed()

    def _books_changed(self) -> None:
        self.num_requests = len(self._by_id)
        self._queued = None
        if self.on_requests_changed is not None:
            self.on_requests_changed()

    # --- the decoding batch ----------------------------------------------------------

    def _hit_tokens(self, seq: S) -> int:
        """The prompt tokens a sequence admitted now would reuse from its trajectory's
        cached prefix (at most all but one: vLLM recomputes the last one to sample)."""
        return min(self.kv.cached_tokens(seq.request.traj_id), seq.num_tokens - 1)

    def _regime(self, batch: int) -> DecodeRegime:
        """The decode coefficients of a step of ``batch`` sequences."""
        decode = self.engine.decode
        return decode.small if batch < decode.large_batch_from else decode.large

    def _join_decoding(self, seq: S, context_tokens: int) -> None:
        """A running sequence, its counters true, starts decoding with ``context_tokens``
        tokens in KV."""
        dec = self._dec
        seq.decoding = True
        seq.mark = dec
        seq.cls = (context_tokens - dec) % BLOCK_TOKENS
        self._hist[seq.cls] += 1
        self._hist[seq.cls + BLOCK_TOKENS] += 1
        self._ctx += context_tokens
        entry = (dec + seq.request.output_tokens - seq.num_generated, seq.order, seq)
        seq.entry = entry
        heapq.heappush(self._heap, entry)

    def _leave_decoding(self, seq: S, context_tokens: int) -> None:
        """A decoding sequence, its counters made true (``context_tokens`` in KV), stops."""
        seq.decoding = False
        seq.entry = None
        self._hist[seq.cls] -= 1
        self._hist[seq.cls + BLOCK_TOKENS] -= 1
        self._ctx -= context_tokens

    def _growth_blocks(self, num_steps: int) -> int:
        """Blocks the decoding sequences need for ``num_steps`` more tokens each.

        A sequence of ``t`` tokens has ``r = -t % BLOCK_TOKENS`` free slots in its last
        block, so ``q * BLOCK_TOKENS + k`` more tokens (``k < BLOCK_TOKENS``) open ``q``
        blocks, plus one when ``r < k``. Its ``cls`` is ``(t - _dec) % BLOCK_TOKENS``, so
        ``r < k`` for the classes ``-_dec - j`` (``j < k``): ``k`` classes in a row."""
        q, k = divmod(num_steps, BLOCK_TOKENS)
        total = q * (self.num_running - len(self._prefilling)) if q else 0
        if k:
            first = (-self._dec - k + 1) % BLOCK_TOKENS
            total += sum(self._hist[first : first + k])
        return total

    def _next_finish_dec(self) -> int | None:
        """The ``_dec`` at which the first decoding sequence finishes (None: none decodes)."""
        heap = self._heap
        while heap and heap[0][2].entry is not heap[0]:
            heapq.heappop(heap)  # a sequence that left
        return heap[0][0] if heap else None

    def _due(self) -> list[S]:
        """The decoding sequences that generated their last token, oldest first, off the
        finish heap (still decoding: the model retires them)."""
        heap = self._heap
        dec = self._dec
        done: list[S] = []
        while heap and heap[0][0] <= dec:
            entry = heapq.heappop(heap)
            if entry[2].entry is entry:
                done.append(entry[2])
        if len(done) > 1:
            done.sort(key=_order)
        return done


def _order(seq: Seq) -> int:
    return seq.order
