"""The KV cache's blocks: allocation, reference counts and prefix caching, as vLLM keeps them.

The cache holds ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns a list
of blocks (its block table). A block whose every token's key and value has been computed
gets a hash of its tokens chained to the previous block's (so equal hashes mean equal
prefixes); a later sequence whose prompt starts with the same full blocks shares them
(reference count) instead of computing them again: that is prefix caching, and it is what
makes a turn of a multi-turn session prefill only its new tokens. A freed block keeps its
hash and stays reusable until it is evicted, least recently freed first, to make room.

Counters in tokens, as vLLM counts them: ``queries_tokens`` (prompt tokens looked up) and
``hits_tokens`` (of those, found cached).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BlockHash = int


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[BlockHash]:
    """The hash of every full block of ``tokens``, each chained to the one before."""
    hashes: list[BlockHash] = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # hash -> block holding it
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.queries_tokens = 0
        self.hits_tokens = 0

    # -- what is free --------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """The fraction of blocks in use (vLLM's ``kv_cache_usage_perc``)."""
        return self.used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix caching ------------------------------------------------------------------

    def cached_prefix(self, tokens: Sequence[int], limit_tokens: int) -> list[int]:
        """The cached blocks that hold the longest prefix of ``tokens`` of at most
        ``limit_tokens`` tokens (nothing is taken: see :meth:`take_prefix`)."""
        if not self.prefix_caching:
            return []
        found: list[int] = []
        for h in chain_hashes(tokens[:limit_tokens], self.block_size):
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def take_prefix(self, blocks: Sequence[int], query_tokens: int) -> None:
        """Take the cached ``blocks`` found for a prompt of ``query_tokens`` tokens, and
        count the query and its hits."""
        for block in blocks:
            self._take(block)
        self.queries_tokens += query_tokens
        self.hits_tokens += len(blocks) * self.block_size

    def free_after_taking(self, blocks: Sequence[int]) -> int:
        """Blocks that would be free once ``blocks`` (cached, maybe free) are taken."""
        return len(self._free) - sum(1 for b in blocks if self._refs[b] == 0)

    def register(self, block: int, h: BlockHash) -> None:
        """``block`` now holds the computed tokens whose chained hash is ``h``."""
        if not self.prefix_caching or self._hash[block] is not None:
            return
        if h in self._cached:  # another block already holds them: keep that one
            return
        self._hash[block] = h
        self._cached[h] = block

    def reset_prefix_cache(self) -> None:
        """Forget every hash (vLLM's ``/reset_prefix_cache``); blocks in use stay in use."""
        self._cached.clear()
        self._hash = [None] * self.num_blocks

    # -- allocation ----------------------------------------------------------------------

    def _take(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (evicting cached free ones, least recently freed first), or
        None, changing nothing, when fewer than ``n`` are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            h = self._hash[block]
            if h is not None:
                self._hash[block] = None
                if self._cached.get(h) == block:
                    del self._cached[h]
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Give back one reference to each block; a block nobody holds becomes free, its
        hash kept for reuse. Freed in reverse, so a sequence's last blocks go first."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise AssertionError(f"block {block} freed twice")
            if self._refs[block] == 0:
                self._free[block] = None
