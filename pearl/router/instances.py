"""The router's table of inference instances, changed by plan steps while traffic flows.

One :class:`Instance` per engine the router may send to: its URL, role and phase, the
requests it has in flight there (the router's own bookkeeping: what it sent and what has
not come back), and what the last scrape of its ``/metrics`` said. It is the
``pearl.serving.views.InstanceLoad`` the routing rules read, and builds the
``InstanceQueue`` they weigh a turn's cost on.

Phases, as the coordinator's plan steps move them (``pearl.core.roles``' vocabulary):
``starting`` (added, takes no traffic), ``ready`` (takes turns), ``draining`` (takes no new
turns; its requests in flight finish), ``switching`` (a role change under way: no
traffic), ``gone`` (removed). A role switch of a ``kv_both`` engine is a routing change:
drain, then the new role.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from pearl.core.profile import EngineProfile
from pearl.core.roles import Phase, Role
from pearl.serving.costs import attention_pairs
from pearl.serving.routing import Candidates, candidates
from pearl.serving.views import InstanceQueue

_ids = itertools.count()


@dataclass(eq=False)
class InFlight:
    """One request the router has sent to an instance and not yet had back."""

    request_id: str
    traj_id: str
    prompt_tokens: int
    cached_tokens: int  # the prefix the router believes cached there
    sent_order: int = field(default_factory=lambda: next(_ids))


@dataclass(eq=False)
class Instance:
    worker_id: str
    url: str
    role: Role
    phase: Phase = Phase.STARTING
    engine: EngineProfile | None = None
    gpu_type: str | None = None  # what it runs on, as the plan step that started it says
    tp: int | None = None
    # its busy time per turn of the traffic's mean shape (``Router.reweigh``); None: not
    # known (no profile, or no GPU type), loads compare as counts
    turn_s: float | None = None
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    scraped_waiting: int = 0  # vllm:num_requests_waiting at the last scrape
    scraped_running: int = 0
    kv_usage: float = 0.0
    # the weights it serves: pearl:weight_version where the engine reports it (pearl's
    # reference engine), else the version the last successful reload loaded (vLLM)
    weight_version: int | None = None
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    # -- InstanceLoad ------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self.phase is Phase.READY

    @property
    def load(self) -> int:
        """Requests there or on their way: the router's own count (it sent them)."""
        return len(self.in_flight)

    @property
    def slots(self) -> int | None:
        """Requests it runs at once, from its engine profile (None without one)."""
        return self.engine.max_num_seqs if self.engine is not None else None

    @property
    def kv_slots(self) -> int | None:
        """Not known to the router (vLLM reports its KV size as vllm:cache_config_info,
        which the router does not read yet)."""
        return None

    # -- bookkeeping -------------------------------------------------------------------

    def sent(self, req: InFlight) -> None:
        self.in_flight[req.request_id] = req
        self.idle.clear()

    def returned(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        if not self.in_flight:
            self.idle.set()

    def queue(self, default: EngineProfile) -> InstanceQueue:
        """The work ahead of a new request, from the router's books and the last scrape:
        of its requests in flight, the newest ``num_requests_waiting`` are taken as still
        queued for prefill (less their cached prefix), the others as decoding."""
        reqs = sorted(self.in_flight.values(), key=lambda r: r.sent_order)
        waiting = min(self.scraped_waiting, len(reqs))
        queued = reqs[len(reqs) - waiting :] if waiting else []
        decoding = reqs[: len(reqs) - waiting]
        new = [max(0, r.prompt_tokens - r.cached_tokens) for r in queued]
        return InstanceQueue(
            engine=self.engine or default,
            queued_prefill_tokens=sum(new),
            queued_prefill_pairs=sum(
                attention_pairs(n, r.cached_tokens) for n, r in zip(new, queued, strict=True)
            ),
            decoding_seqs=len(decoding),
            decoding_context_tokens=sum(r.prompt_tokens for r in decoding),
            batch_seqs=len(reqs),
        )


class UnknownInstance(KeyError):
    """A plan step names an instance the router does not have."""


class InstanceTable:
    def __init__(self) -> None:
        self._by_id: dict[str, Instance] = {}
        self._candidates: Candidates | None = None
        # set whenever an instance starts or stops accepting, or a full one has room again
        self.changed = asyncio.Event()
        # the latest weights published: what an engine added now serves (each loads them
        # before the router takes it)
        self.published_version: int | None = None

    def __iter__(self) -> Iterator[Instance]:
        return iter(self._by_id.values())

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._by_id

    def get(self, worker_id: str) -> Instance:
        try:
            return self._by_id[worker_id]
        except KeyError:
            raise UnknownInstance(worker_id) from None

    def candidates(self) -> Candidates:
        if self._candidates is None:
            self._candidates = candidates(self._by_id.values())
        return self._candidates

    def _touch(self) -> None:
        self._candidates = None
        self.wake()

    def wake(self) -> None:
        """Wake the turns parked on ``changed``: an instance joined or left, or one that
        was full has room again (``pearl.serving.routing.full``)."""
        self.changed.set()
        self.changed = asyncio.Event()

    # -- plan steps --------------------------------------------------------------------

    def add(
        self,
        worker_id: str,
        url: str,
        role: Role,
        engine: EngineProfile | None = None,
        gpu_type: str | None = None,
        tp: int | None = None,
    ) -> Instance:
        """A started engine: known, but it takes traffic only once :meth:`ready`."""
        if worker_id in self._by_id:
            raise ValueError(f"instance {worker_id} is already in the router's table")
        inst = self._by_id[worker_id] = Instance(
            worker_id,
            url.rstrip("/"),
            role,
            engine=engine,
            gpu_type=gpu_type,
            tp=tp,
            weight_version=self.published_version,
        )
        return inst

    def weights_loaded(self, worker_id: str, version: int) -> None:
        """``worker_id`` reloaded the published ``version`` (the publisher says so); an
        instance no longer in the table is nothing to note."""
        self.published_version = max(version, self.published_version or version)
        inst = self._by_id.get(worker_id)
        if inst is not None:
            inst.weight_version = version

    def serve(self, worker_id: str, url: str, role: Role) -> Instance:
        """An engine already healthy: added and ready at once (a fixed configuration)."""
        inst = self.add(worker_id, url, role)
        self.ready(worker_id)
        return inst

    def ready(self, worker_id: str, role: Role | None = None) -> None:
        inst = self.get(worker_id)
        if role is not None:
            inst.role = role
        inst.phase = Phase.READY
        self._touch()

    def drain(self, worker_id: str) -> Instance:
        inst = self.get(worker_id)
        inst.phase = Phase.DRAINING
        self._touch()
        return inst

    def switching(self, worker_id: str) -> Instance:
        """A role change under way: out of traffic until :meth:`switch`."""
        inst = self.get(worker_id)
        inst.phase = Phase.SWITCHING
        self._touch()
        return inst

    def switch(self, worker_id: str, role: Role) -> None:
        """A role change (after a drain): a routing change for a ``kv_both`` engine."""
        inst = self.get(worker_id)
        inst.role = role
        inst.phase = Phase.READY
        self._touch()

    def remove(self, worker_id: str) -> Instance:
        inst = self._by_id.pop(worker_id)
        inst.phase = Phase.GONE
        self._touch()
        return inst
