"""The least-loaded index (pearl.serving.load_index) answers as routing.least_loaded's scan
under any sequence of load changes, ignores views that are not its members, and stays
small."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from pearl.core.roles import Role
from pearl.serving.load_index import CandidateLoads, LoadIndex
from pearl.serving.routing import candidates, least_loaded


@dataclass
class Load:
    """A mutable ``InstanceLoad``: a router's live record of an instance."""

    worker_id: str
    role: Role = Role.COLOCATED
    accepting: bool = True
    load: int = 0
    slots: int | None = None
    kv_slots: int | None = None
    turn_s: float | None = None


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 12),
    st.lists(st.tuples(st.integers(0, 11), st.integers(-3, 3)), max_size=200),
)
def test_the_index_is_the_scan_after_every_change(n: int, changes: list[tuple[int, int]]) -> None:
    # some with few slots (full ones rank after those with room), some with none known;
    # busy times per turn of three kinds, equal ones among them (ties)
    views = [
        Load(
            f"w{i:02d}",
            load=i % 3,
            slots=(i % 4) + 2 if i % 3 else None,
            kv_slots=i % 3 + 1,
            turn_s=(0.2, 0.5, 1.0)[i % 3],
        )
        for i in range(n)
    ]
    index = LoadIndex(views)
    assert index.least() is least_loaded(views)
    for which, delta in changes:
        view = views[which % n]
        view.load = max(0, view.load + delta)
        index.changed(view)
        assert index.least() is least_loaded(views)
        assert len(index._heap) <= 4 * n + 16 + 1


def test_ties_go_to_the_smallest_worker_id_and_strangers_are_ignored() -> None:
    a, b, c = Load("b", load=1), Load("a", load=1), Load("c", load=2)
    index = LoadIndex([a, b, c])
    assert index.least() is b
    b.load = 3
    index.changed(b)
    assert index.least() is a
    stranger = Load("a", load=0)  # another object under a member's id (a switch)
    index.changed(stranger)
    assert index.least() is a
    assert LoadIndex([]).least() is None


def test_candidate_loads_keep_entries_and_decodes_apart() -> None:
    views = [Load("p0", Role.PREFILL, load=2), Load("d0", Role.DECODE), Load("d1", Role.DECODE)]
    cands = candidates(views)
    loads = CandidateLoads(cands.entries, cands.decodes)
    assert loads.least_loaded_entry() is views[0]
    assert loads.least_loaded_decode() is views[1]
    views[1].load = 5
    loads.changed(views[1])
    assert loads.least_loaded_decode() is views[2] is cands.least_loaded_decode()
