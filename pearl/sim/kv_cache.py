"""KV-cache blocks of one simulated engine instance, with a per-trajectory prefix cache.

The cache is counted in blocks of ``BLOCK_TOKENS`` tokens (vLLM's default block size).
Every block is in exactly one of three states:

- *held* by a sequence the engine is running (``num_held_blocks``);
- *cached*: the full blocks of a trajectory's last turn (prompt and output), kept after
  the sequence left so that the trajectory's next turn skips their prefill, and evicted
  least recently used first when blocks run short (``cached_tokens``);
- *free*.

Only full blocks are cached (vLLM hashes full blocks only). A trajectory has at most one
cached prefix; a sequence that is admitted *claims* its trajectory's prefix (the blocks
become held), so cached prefixes belong to trajectories that are not running.

Invariants (``tests/sim/test_engine.py``): ``num_held_blocks + num_cached_blocks <=
num_blocks`` at all times; an allocation either succeeds whole or changes nothing but
evictions; eviction removes whole least-recently-used prefixes until the request fits.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK_TOKENS = 16


def blocks_for(num_tokens: int) -> int:
    """Blocks that hold ``num_tokens`` tokens (the last one possibly partial)."""
    return -(-num_tokens // BLOCK_TOKENS)


class KvCache:
    """Block accounting of one instance: held, cached (LRU per trajectory) and free."""

    def __init__(self, capacity_tokens: int) -> None:
        self.num_blocks = capacity_tokens // BLOCK_TOKENS
        if self.num_blocks < 1:
            raise ValueError(f"kv capacity of {capacity_tokens} tokens holds no block")
        self.num_held_blocks = 0
        self.num_cached_blocks = 0
        self._prefix_blocks: OrderedDict[str, int] = OrderedDict()  # LRU first

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_held_blocks - self.num_cached_blocks

    def cached_tokens(self, traj_id: str) -> int:
        """Tokens of the trajectory's cached prefix (a multiple of ``BLOCK_TOKENS``)."""
        return self._prefix_blocks.get(traj_id, 0) * BLOCK_TOKENS

    def can_hold(self, num_blocks: int, traj_id: str) -> bool:
        """Whether ``num_blocks`` more blocks fit, evicting any prefix but ``traj_id``'s."""
        own = self._prefix_blocks.get(traj_id, 0)
        return num_blocks <= self.num_free_blocks + self.num_cached_blocks - own

    def claim(self, traj_id: str, max_blocks: int) -> int:
        """Turn up to ``max_blocks`` of the trajectory's prefix into held blocks.

        Returns the blocks claimed; the rest of the prefix, if any, is freed."""
        cached = self._prefix_blocks.pop(traj_id, 0)
        claimed = min(cached, max_blocks)
        self.num_cached_blocks -= cached
        self.num_held_blocks += claimed
        return claimed

    def allocate(self, num_blocks: int) -> bool:
        """Hold ``num_blocks`` more blocks, evicting LRU prefixes; False if they never fit."""
        while self.num_free_blocks < num_blocks and self._prefix_blocks:
            _, evicted = self._prefix_blocks.popitem(last=False)
            self.num_cached_blocks -= evicted
        if self.num_free_blocks < num_blocks:
            return False
        self.num_held_blocks += num_blocks
        return True

    def release(self, num_blocks: int, traj_id: str, keep_tokens: int) -> None:
        """A sequence lets go of its blocks; the full ones of its first ``keep_tokens``
        tokens become (or extend) the trajectory's cached prefix, the most recently used."""
        self.num_held_blocks -= num_blocks
        keep = min(keep_tokens // BLOCK_TOKENS, num_blocks)
        old = self._prefix_blocks.pop(traj_id, 0)
        kept = max(old, keep)  # one prefix chain per trajectory: the longer survives
        self.num_cached_blocks += kept - old
        if kept:
            self._prefix_blocks[traj_id] = kept
