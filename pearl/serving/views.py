"""What a router knows of one inference instance when it routes a turn.

Two views, in terms a real router also has (its own bookkeeping of what it sent where and
what came back, or an engine's metrics endpoint), none of them a simulator's internals:

- ``InstanceLoad``, for every instance: its role, whether it accepts requests, and its
  load (requests running, waiting and in flight to it). The routing rules need this of
  every candidate (least loaded).
- ``InstanceQueue``, for the few instances a turn's cost is weighed on: the engine profile
  it runs (prefill and decode coefficients, step budget), the prefill work queued ahead of
  a new request, its decoding batch, and the batch a new turn would decode in.

The third thing a router knows, the prefix of the trajectory being routed that is cached
on its *home* (the instance it last sent the trajectory to: the prompt it sent, and the
output when that instance decoded it), is an argument of the rules, not a view: the
router's belief, not the cache's truth (an evicted prefix still counts).

Invariants: every count is >= 0; ``queued_prefill_pairs`` is >= ``queued_prefill_tokens``
(each new token attends at least to itself); ``batch_seqs`` >= ``decoding_seqs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pearl.core.profile import EngineProfile
from pearl.core.roles import Role


class InstanceLoad(Protocol):
    """One instance's role, admission and requests (read-only). A protocol, so that a
    router passes its own records of its instances, built once, rather than a new view of
    every instance at every route."""

    @property
    def worker_id(self) -> str: ...

    @property
    def role(self) -> Role: ...

    @property
    def accepting(self) -> bool:
        """It takes new requests (not starting, draining, switching or gone)."""
        ...

    @property
    def load(self) -> int:
        """Requests it holds or will hold: running, waiting, and routed to it but not
        there yet (a tool call or a KV transfer on its way)."""
        ...

    @property
    def slots(self) -> int | None:
        """Requests it runs at once (vLLM's ``max_num_seqs``); None: not known (never
        full)."""
        ...

    @property
    def kv_slots(self) -> int | None:
        """Contexts of the workload's size its KV cache holds (``routing.kv_slots``);
        None: not known."""
        ...


def full(view: InstanceLoad) -> bool:
    """It holds as many requests as it runs at once: one more would only queue there."""
    slots = view.slots
    return slots is not None and view.load >= slots


CROWDED_RANK = 1 << 40  # above any load: ranks after every instance with room
FULL_RANK = 1 << 41  # and after every crowded one


def load_rank(view: InstanceLoad) -> int:
    """The least-loaded rule's key: the load, after every instance with room in its KV
    cache if its trajectories fill it (*crowded*: a turn more evicts a prefix one of them
    comes back to), and after every crowded one if full."""
    load = view.load
    slots = view.slots
    if slots is not None and load >= slots:
        return load + FULL_RANK
    kv_slots = view.kv_slots
    return load + CROWDED_RANK if kv_slots is not None and load >= kv_slots else load


@dataclass(frozen=True, slots=True)
class InstanceQueue:
    """The work ahead of a new request on one instance.

    The queued prefill work is the prompt tokens not computed yet of every request
    admitted and still prefilling and of every request waiting (less what each will find
    cached), and the token pairs their attention computes: a chunk of ``n`` new tokens after
    ``p`` computed ones counts ``(p + n)**2 - p**2``, the quadratic term of
    ``PrefillCoeffs.batch_s``. The decoding batch is the running sequences whose prompt is
    computed: each decodes one token in every step a queued prefill chunk runs in. The
    batch a new turn decodes in is every request the instance holds or will hold before it
    (``InstanceLoad.load``); ``batch_seqs`` >= ``decoding_seqs``.
    """

    engine: EngineProfile
    queued_prefill_tokens: int = 0
    queued_prefill_pairs: int = 0
    decoding_seqs: int = 0
    decoding_context_tokens: int = 0  # the KV the decoding batch holds, summed
    batch_seqs: int = 0  # requests running, waiting and incoming: a new turn decodes beside them
