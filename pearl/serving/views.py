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

    @property
    def turn_s(self) -> float | None:
        """Its busy time per turn of the workload's mean shape (``routing.turn_work_s``):
        the least-loaded rule weighs its load by it; None: not known (loads compare as
        counts)."""
        ...


def full(view: InstanceLoad) -> bool:
    """It holds as many requests as it runs at once: one more would only queue there."""
    slots = view.slots
    return slots is not None and view.load >= slots


CROWDED_RANK = 1e9  # above any instance's load in seconds: ranks after every one with room
FULL_RANK = 2e9  # and after every crowded one


def load_rank(view: InstanceLoad) -> float:
    """The least-loaded rule's key: the time the instance needs for what it holds and one
    turn more, ``(load + 1) * turn_s`` (the load itself without ``turn_s``), after every
    instance with room in its KV cache if its trajectories fill it (*crowded*: a turn more
    evicts a prefix one of them comes back to), and after every crowded one if full.

    Weighed by ``turn_s``, equal instances rank by their loads, and an instance that
    serves a turn in a fifth of the time takes about five times the turns of a slow one
    (an H20 prefills the shipped workload's prompts three times slower than an H800 and
    decodes as fast: counted alone, a fleet of both loaded the H20s as much as H800
    instances of four GPUs each; ``docs/simulator.md``, "Unequal instances")."""
    load = view.load
    turn_s = view.turn_s
    rank = (load + 1) * turn_s if turn_s is not None else float(load)
    slots = view.slots
    if slots is not None and load >= slots:
        return rank + FULL_RANK
    kv_slots = view.kv_slots
    return rank + CROWDED_RANK if kv_slots is not None and load >= kv_slots else rank


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
