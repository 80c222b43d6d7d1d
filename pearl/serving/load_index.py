"""The least-loaded instance of a set, kept as loads change instead of found by a scan.

``routing.least_loaded`` scans every candidate at every route: fine for a handful of
instances, the simulator's largest cost at hundreds (a 256-GPU run routes tens of
thousands of turns over a hundred and more instances each). ``LoadIndex`` answers the same
question from a heap of ``(rank, worker_id)`` keys (``views.load_rank``): the owner
calls ``changed(view)`` whenever a member's load may have changed (a request submitted,
finished, aborted, or sent on its way to it), and ``least()`` pops the keys that no longer hold.
``CandidateLoads`` holds one index for the entries and one for the decode instances of a
``routing.Candidates``, and is what ``routing.route_turn`` and ``routing.route_decode``
take as their ``order``; its changes are reported by appending to a list, applied at the
next query.

Invariants: the members are fixed at construction (a router builds a new index when its
candidates change); ``least()`` is ``routing.least_loaded`` of the members as long as
every change of a member's load was reported before the call (the same tie rule: the
smallest worker id); ``changed`` of a view that is not a member (another object under a
member's worker id too) does nothing; the heap holds at most about four keys per member.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from pearl.serving.views import InstanceLoad, load_rank

# (rank, worker_id, stamp, view): the key is (rank, worker_id), the rank ``views.load_rank``
# (the load weighed by the instance's busy time per turn, after every instance with room if
# crowded or full); the stamp tells whether the key is still the member's (it was the last
# pushed for it)
_Key = tuple[float, str, int, InstanceLoad]


class LoadIndex:
    """The least-loaded of a fixed set of instances, ties to the smallest worker id."""

    def __init__(self, members: Iterable[InstanceLoad]) -> None:
        self._views: dict[str, InstanceLoad] = {}
        self._keys: dict[str, tuple[float, int]] = {}  # worker id -> (rank, stamp) pushed
        self._stamp = 0
        self._heap: list[_Key] = []
        for view in members:
            self._views[view.worker_id] = view
        self._rebuild()

    def __len__(self) -> int:
        return len(self._views)

    def worker_ids(self) -> list[str]:
        return list(self._views)

    def _rebuild(self) -> None:
        self._stamp += 1
        stamp = self._stamp
        self._keys = {wid: (load_rank(view), stamp) for wid, view in self._views.items()}
        self._heap = [(rank, wid, stamp, self._views[wid]) for wid, (rank, _) in self._keys.items()]
        heapq.heapify(self._heap)

    def changed(self, view: InstanceLoad) -> None:
        """The view's load may have changed (nothing happens if it has not)."""
        wid = view.worker_id
        key = self._keys.get(wid)
        if key is None or self._views[wid] is not view:
            return
        rank = load_rank(view)
        if rank == key[0]:
            return
        self._stamp += 1
        self._keys[wid] = (rank, self._stamp)
        heapq.heappush(self._heap, (rank, wid, self._stamp, view))
        if len(self._heap) > 4 * len(self._keys) + 16:
            self._rebuild()

    def least(self) -> InstanceLoad | None:
        """``routing.least_loaded`` of the members: the least ``views.load_rank``, ties to
        the smallest worker id; None for no member."""
        heap, keys = self._heap, self._keys
        while heap:
            _, wid, stamp, view = heap[0]
            if keys[wid][1] == stamp:
                return view
            heapq.heappop(heap)
        return None


class CandidateLoads:
    """The least-loaded entry and decode instance of one set of candidates.

    Changes are reported by appending the view to ``changes`` (a list the owner may share
    with whatever changes loads, and append to without a call into this class: a bound
    ``list.append`` costs next to nothing); they are applied at the next query. Building
    one reads every member's load afresh and empties ``changes``."""

    def __init__(
        self,
        entries: Iterable[InstanceLoad],
        decodes: Iterable[InstanceLoad],
        changes: list[InstanceLoad] | None = None,
    ) -> None:
        self.changes: list[InstanceLoad] = changes if changes is not None else []
        self.changes.clear()
        self._entries = LoadIndex(entries)
        self._decodes = LoadIndex(decodes)
        self._index_of: dict[str, LoadIndex] = {}
        for index in (self._entries, self._decodes):
            for wid in index.worker_ids():
                self._index_of[wid] = index

    def changed(self, view: InstanceLoad) -> None:
        self.changes.append(view)

    def _apply(self) -> None:
        index_of = self._index_of
        for view in self.changes:
            index = index_of.get(view.worker_id)
            if index is not None:
                index.changed(view)
        self.changes.clear()

    def least_loaded_entry(self) -> InstanceLoad | None:
        if self.changes:
            self._apply()
        return self._entries.least()

    def least_loaded_decode(self) -> InstanceLoad | None:
        if self.changes:
            self._apply()
        return self._decodes.least()
