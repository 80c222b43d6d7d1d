"""The reference engine's core: one thread that steps the model over the scheduled batch.

Everything that touches the model, the KV cache or a sequence runs on this thread, between
steps: requests come in through :meth:`EngineCore.submit`, and every other operation
(abort, pause, sleep, wake, weight loads, KV hand-off) through :meth:`EngineCore.call`,
which runs a function on the thread at the next step boundary and returns a future. The
server (``server.py``) is asyncio; it waits on those futures and gets each sequence's
tokens through the sequence's ``emit`` callback.

Per step: the scheduler's batch is computed in up to three groups (decodes, one token
each; prefill chunks; sequences whose prompt's KV was pulled from a prefill instance,
which compute nothing), then each sequence whose tokens are all computed samples its next
token and is checked for a stop. A prefill for a remote decode (``hold_kv``) keeps its
blocks when it finishes, under a lease, until a decode instance pulls them or the lease
expires.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import gc
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from pearl.engines.reference.blocks import BlockManager
from pearl.engines.reference.metrics import EngineMetrics
from pearl.engines.reference.model import CausalLM, KVPool, SeqInput
from pearl.engines.reference.sampling import sample
from pearl.engines.reference.scheduler import Scheduler, SchedulerConfig
from pearl.engines.reference.sequence import Finish, Seq, Status, TokenEvent

T = TypeVar("T")


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefix_caching: bool = True
    kv_lease_s: float = 30.0


@dataclass
class HeldKV:
    """A finished prefill's KV, kept for the decode instance that will pull it."""

    seq: Seq
    expires_s: float


def _trim_heap() -> None:
    """Hand freed memory back to the operating system, so sleep shows in the RSS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class EngineCore:
    def __init__(
        self,
        model: CausalLM,
        cfg: EngineConfig,
        metrics: EngineMetrics,
        *,
        eos_token_ids: Sequence[int],
        detokenize: Callable[[Sequence[int]], str],
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.metrics = metrics
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.kv = KVPool(model.cfg, cfg.num_blocks * cfg.block_size, model.dtype)
        self.blocks = BlockManager(
            cfg.num_blocks, cfg.block_size, prefix_caching=cfg.prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens), self.blocks
        )
        self.weight_version = 0
        self.paused = False  # mode keep: nothing steps; abort/wait also stop admission
        self.held: dict[str, HeldKV] = {}
        self.steps = 0
        self.error: str | None = None  # the traceback of a step that failed
        self._inbox: list[Seq] = []
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)

    # -- the interface (any thread) ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=5)

    def submit(self, seq: Seq) -> None:
        with self._wake:
            self._inbox.append(seq)
            self._wake.notify()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the engine thread between steps."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._wake:
            self._calls.append((fn, fut))
            self._wake.notify()
        return fut

    @property
    def asleep(self) -> bool:
        return not (self.kv.allocated and self.model.loaded)

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stop or self._calls or self._inbox or self._can_step()):
                    self._wake.wait(timeout=1.0)
                    if self._expire_leases():
                        self._publish()
                if self._stop:
                    return
                calls, self._calls = self._calls, []
                inbox, self._inbox = self._inbox, []
            for seq in inbox:
                self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
                self.scheduler.add(seq)
            for fn, fut in calls:
                try:
                    fut.set_result(fn())
                except Exception as err:  # the caller gets it
                    fut.set_exception(err)
            self._expire_leases()
            stepped = False
            if self._can_step():
                try:
                    stepped = self._step()
                except Exception:  # a bug: answer every request, report unhealthy
                    self.error = traceback.format_exc()
                    print(self.error, file=sys.stderr, flush=True)
                    self.abort_all()
            self._publish()
            if self._can_step() and not stepped:
                # the queue's head waits for blocks that only a lease's expiry frees:
                # wait for news instead of spinning
                with self._wake:
                    if not (self._stop or self._calls or self._inbox):
                        self._wake.wait(timeout=0.05)

    def _can_step(self) -> bool:
        s = self.scheduler
        return (
            not self.paused
            and not self.asleep
            and (bool(s.running) or (s.admit and bool(s.waiting)))
        )

    def _step(self) -> bool:
        """One step of the scheduled batch; False if nothing could be scheduled."""
        batch = self.scheduler.schedule()
        if not batch:
            return False
        now = time.monotonic()
        for seq, _ in batch:
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = now
                self.metrics.queue_time.observe(now - seq.arrival_s)
        decodes = [(s, n) for s, n in batch if n == 1 and s.pending == 1]
        prefills = [(s, n) for s, n in batch if n > 1 or (n == 1 and s.pending > 1)]
        remotes = [s for s, n in batch if n == 0]
        ready: list[tuple[Seq, torch.Tensor]] = []
        for group in (decodes, prefills):
            if group:
                ready += self._forward(group)
        for seq in remotes:
            ready.append(self._load_remote(seq))
        self.steps += 1
        for seq, logits in ready:
            self._sample(seq, logits)
        return True

    def _forward(self, group: list[tuple[Seq, int]]) -> list[tuple[Seq, torch.Tensor]]:
        bs = self.cfg.block_size
        inputs = []
        for seq, n in group:
            start = seq.num_computed
            ids = seq.all_ids[start : start + n]
            inputs.append(SeqInput(ids, start, seq.slots(bs, start + n)))
        logits = self.model.forward(inputs, self.kv)
        done = []
        for (seq, n), row in zip(group, logits, strict=True):
            prompt_left = max(0, len(seq.prompt_ids) - seq.num_computed)
            seq.computed_prompt_tokens += min(n, prompt_left)
            self.metrics.prompt_tokens_computed.inc(min(n, prompt_left))
            seq.num_computed += n
            self._hash_blocks(seq)
            if seq.pending == 0:
                done.append((seq, row))
        return done

    def _load_remote(self, seq: Seq) -> tuple[Seq, torch.Tensor]:
        assert seq.remote is not None and self.kv.k is not None and self.kv.v is not None
        n = len(seq.prompt_ids)
        slots = seq.slots(self.cfg.block_size, n)
        self.kv.k[:, slots] = seq.remote.keys.to(self.kv.dtype)
        self.kv.v[:, slots] = seq.remote.values.to(self.kv.dtype)
        seq.num_computed = n
        self._hash_blocks(seq)
        logits = seq.remote.logits
        seq.remote = None  # the transferred tensors are not needed any more
        return seq, logits

    def _hash_blocks(self, seq: Seq) -> None:
        bs = self.cfg.block_size
        full = seq.num_computed // bs
        if full <= seq.num_hashed_blocks or not (self.cfg.prefix_caching and seq.cacheable):
            return
        ids = seq.all_ids
        parent = seq.block_hashes[seq.num_hashed_blocks - 1] if seq.num_hashed_blocks else 0
        for b in range(seq.num_hashed_blocks, full):
            if b < len(seq.block_hashes):
                h = seq.block_hashes[b]
            else:
                h = hash((parent, tuple(ids[b * bs : (b + 1) * bs])))
                seq.block_hashes.append(h)
            self.blocks.register(seq.blocks[b], h)
            parent = h
        seq.num_hashed_blocks = full

    def _sample(self, seq: Seq, logits: torch.Tensor) -> None:
        s = sample(logits, seq.params, seq.generator)
        now = time.monotonic()
        seq.output_ids.append(s.token_id)
        self.metrics.generation_tokens.inc()
        prefill_s = None
        if seq.first_token_s is None:
            seq.first_token_s = now
            self.metrics.ttft.observe(now - seq.arrival_s)
            if seq.first_scheduled_s is not None:
                prefill_s = now - seq.first_scheduled_s
                self.metrics.prefill_time.observe(prefill_s)
        elif seq.last_token_s is not None:
            self.metrics.itl.observe(now - seq.last_token_s)
        seq.last_token_s = now
        finish, reason = self._stopped(seq, s.token_id)
        event = TokenEvent(
            (s.token_id,),
            (s.logprob,),
            (s.top_logprobs,),
            (self.weight_version,),
            finish,
            reason,
            prefill_s=prefill_s,
        )
        if finish is not None:
            event = self._finish(seq, finish, event, logits)
        seq.emit(event)

    def _stopped(self, seq: Seq, token: int) -> tuple[Finish | None, int | str | None]:
        p = seq.params
        n_out = len(seq.output_ids)
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                return Finish.STOP, token
            if not p.ignore_eos and token in self.eos_token_ids:
                return Finish.STOP, None
            if p.stop:
                text = self.detokenize(seq.output_ids)
                for stop in p.stop:
                    if stop in text:
                        return Finish.STOP, stop
        if n_out >= p.max_tokens or seq.num_tokens >= self.cfg.max_model_len:
            return Finish.LENGTH, None
        return None, None

    def _finish(
        self, seq: Seq, finish: Finish, event: TokenEvent, logits: torch.Tensor | None
    ) -> TokenEvent:
        now = time.monotonic()
        seq.status = Status.FINISHED
        self.metrics.e2e.observe(now - seq.arrival_s)
        if seq.first_token_s is not None:
            self.metrics.decode_time.observe(now - seq.first_token_s)
        self.metrics.success(finish.value)
        self.metrics.request_prompt_tokens.observe(len(seq.prompt_ids))
        self.metrics.request_generation_tokens.observe(len(seq.output_ids))
        if seq.hold_kv and finish is Finish.LENGTH and logits is not None:
            # keep the prompt's KV (not the sampled token's) for the decode instance
            self.scheduler.running.remove(seq)
            seq.last_logits = logits.clone()
            self.held[seq.request_id] = HeldKV(seq, now + self.cfg.kv_lease_s)
            params = {"remote_block_ids": list(seq.blocks), "num_tokens": len(seq.prompt_ids)}
            return TokenEvent(**{**event.__dict__, "kv_transfer_params": params})
        self.scheduler.remove(seq)
        return event

    def _expire_leases(self) -> bool:
        """Free the KV of prefills whose lease ran out; whether there was any."""
        now = time.monotonic()
        expired = [r for r, h in self.held.items() if h.expires_s <= now]
        for rid in expired:
            self.blocks.free(self.held.pop(rid).seq.blocks)
        return bool(expired)

    def publish_metrics(self) -> None:
        """The gauges as of now (run on the engine thread: ``GET /metrics`` asks for it, so
        a scrape right after an operation sees what the operation did)."""
        self._publish()

    def _publish(self) -> None:
        m, s = self.metrics, self.scheduler
        m.running.set(len(s.running))
        m.waiting.set(len(s.waiting))
        m.kv_usage.set(self.blocks.usage())
        m.weight_version.set(self.weight_version)
        m.num_preemptions.set_total(s.num_preemptions)
        m.prefix_queries.set_total(self.blocks.queries_tokens)
        m.prefix_hits.set_total(self.blocks.hits_tokens)

    # -- operations run through call() -------------------------------------------------

    def abort(self, request_ids: Sequence[str]) -> int:
        """Finish the named sequences with ``abort``; their tokens so far stand."""
        wanted = set(request_ids)

        def named(rid: str) -> bool:
            return rid in wanted or rid.rsplit("#", 1)[0] in wanted

        found = [
            s for s in [*self.scheduler.running, *self.scheduler.waiting] if named(s.request_id)
        ]
        for seq in found:
            self._abort(seq)
        held = [rid for rid in self.held if named(rid)]
        for rid in held:  # a prefill nobody will pull now: its KV is freed at once
            self.blocks.free(self.held.pop(rid).seq.blocks)
        return len(found) + len(held)

    def _abort(self, seq: Seq) -> None:
        event = TokenEvent((), (), (), (), Finish.ABORT)
        seq.emit(self._finish(seq, Finish.ABORT, event, None))

    def abort_all(self) -> int:
        seqs = [*self.scheduler.running, *self.scheduler.waiting]
        for seq in seqs:
            self._abort(seq)
        return len(seqs)

    def take_held(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The held prefill's keys, values and last logits; its blocks freed. KeyError if
        no prefill of that id is held (never made, already pulled, or expired)."""
        held = self.held.pop(request_id)
        assert self.kv.k is not None and self.kv.v is not None
        seq = held.seq
        slots = seq.slots(self.cfg.block_size, len(seq.prompt_ids))
        keys, values = self.kv.k[:, slots].clone(), self.kv.v[:, slots].clone()
        self.blocks.free(seq.blocks)
        assert seq.last_logits is not None
        return keys, values, seq.last_logits

    def sleep(self, level: int) -> None:
        """Level 1: the KV cache's memory is freed (running requests are aborted, their
        partial output returned; waiting ones wait for the wake; held prefills are
        dropped, so a decode that comes to pull one gets a 400); level 2: the weights'
        too."""
        for seq in list(self.scheduler.running):
            self._abort(seq)
        for held in self.held.values():
            self.blocks.free(held.seq.blocks)
        self.held.clear()
        self.blocks.reset_prefix_cache()
        self.kv.release()
        if level >= 2:
            self.model.release()
        _trim_heap()

    def wake_kv(self) -> None:
        self.kv.allocate()

    def load_weights(
        self, tensors: dict[str, torch.Tensor], version: int | None, *, partial: bool = False
    ) -> int:
        """New weights (all, or some when ``partial``): running sequences go on under them
        (their tokens from now carry the new version); the prefix cache is reset, since its
        blocks hold the old weights' keys and values."""
        self.model.load(tensors, partial=partial)
        self.weight_version = self.weight_version + 1 if version is None else version
        self.reset_prefix_cache()
        return self.weight_version

    def reset_prefix_cache(self) -> None:
        """Forget every cached block. A sequence in flight keeps its blocks, but none it
        fills from now is cached: their keys attend to the old ones."""
        self.blocks.reset_prefix_cache()
        for seq in [*self.scheduler.running, *(h.seq for h in self.held.values())]:
            seq.cacheable = False
