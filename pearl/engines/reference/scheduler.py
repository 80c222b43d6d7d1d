"""Which sequences run in the next step, and how many of their tokens: vLLM's rules, small.

Continuous batching: a step takes every running sequence (admission order) and then
admits waiting ones (first come, first served) while there is room, so requests join and
leave the batch at every step. Each step has a token budget (``max_num_batched_tokens``):
a decode takes one token of it, a prefill as many as are left (chunked prefill: a long
prompt is computed over several steps). Blocks are allocated for the tokens a step
computes; admission stops when a sequence's blocks do not fit (head of line waits). When a
running sequence needs a block and none is free, the most recently admitted running
sequence is preempted: its blocks are freed and it goes back to the front of the queue, to
be computed again from its tokens (vLLM's preemption by recompute), counted in
``num_preemptions``.

A sequence whose prompt's KV came from a prefill instance (``Seq.remote``) is admitted with
blocks for its whole prompt and scheduled for zero tokens: the engine copies the KV in and
samples its first token from the transferred logits, computing no prompt token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pearl.engines.reference.blocks import BlockManager, chain_hashes
from pearl.engines.reference.sequence import Seq, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager) -> None:
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.num_preemptions = 0
        self.admit = True  # False while paused with mode=wait: running sequences go on

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Seq) -> None:
        """Take ``seq`` out (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.blocks)
        seq.blocks = []

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_hashed_blocks = 0
        seq.cacheable = True  # computed again from scratch, under the weights of then
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _grow(self, seq: Seq, num_tokens: int) -> bool:
        """Blocks for ``seq``'s first ``num_tokens`` tokens; False if none are free."""
        need = self.blocks.blocks_for(num_tokens) - len(seq.blocks)
        if need <= 0:
            return True
        new = self.blocks.allocate(need)
        if new is None:
            return False
        seq.blocks.extend(new)
        return True

    def schedule(self) -> list[tuple[Seq, int]]:
        """The next step: ``(sequence, tokens to compute)`` pairs, budget and blocks
        allowing."""
        budget = self.cfg.max_num_batched_tokens
        out: list[tuple[Seq, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.pending, budget)
            while not self._grow(seq, seq.num_computed + n):
                self._preempt(self.running[-1])
                if seq.status is Status.WAITING:  # it was the last one
                    break
            if seq.status is Status.WAITING:
                break
            out.append((seq, n))
            budget -= n
            i += 1
        while self.admit and self.waiting and budget > 0:
            if len(self.running) >= self.cfg.max_num_seqs:
                break
            seq = self.waiting[0]
            admitted = self._admit(seq, budget)
            if admitted is None:
                break
            n = admitted
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append((seq, n))
            budget -= n
        return out

    def _admit(self, seq: Seq, budget: int) -> int | None:
        """Blocks for ``seq``'s first step, and its token count; None if they don't fit."""
        if seq.remote is not None:
            return 0 if self._grow(seq, len(seq.prompt_ids)) else None
        tokens = seq.all_ids
        # the last token is always computed: its logits give the next token
        cached = self.blocks.cached_prefix(tokens, len(tokens) - 1)
        start = len(cached) * self.blocks.block_size
        n = min(len(tokens) - start, budget)
        need = self.blocks.blocks_for(start + n) - len(cached)
        if self.blocks.free_after_taking(cached) < need:
            return None
        self.blocks.take_prefix(cached, len(tokens))
        seq.blocks = list(cached)
        seq.num_computed = start
        seq.num_hashed_blocks = len(cached)
        if len(seq.block_hashes) < len(cached):
            seq.block_hashes = chain_hashes(tokens[:start], self.blocks.block_size)
        seq.cached_prompt_tokens = min(start, len(seq.prompt_ids))
        grown = self._grow(seq, start + n)
        assert grown
        return n
