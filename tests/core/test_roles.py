from __future__ import annotations

import pytest

from pearl.core.roles import (
    PHASE_EDGES,
    ROLES_BY_KIND,
    Phase,
    Role,
    TransitionError,
    WorkerKind,
    check_phase_edge,
    check_role,
    check_role_change,
)


def test_every_edge_has_a_comment() -> None:
    assert all(len(comment) > 10 for comment in PHASE_EDGES.values())


def test_gone_is_terminal() -> None:
    assert not [e for e in PHASE_EDGES if e[0] is Phase.GONE]


def test_every_live_phase_can_be_lost_and_left() -> None:
    for phase in Phase:
        if phase is not Phase.GONE:
            assert (phase, Phase.GONE) in PHASE_EDGES or (phase, Phase.STOPPING) in PHASE_EDGES


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param(Phase.GONE, Phase.READY, id="resurrection"),
        pytest.param(Phase.STARTING, Phase.DRAINING, id="drain-before-ready"),
        pytest.param(Phase.STOPPING, Phase.READY, id="stop-is-final"),
        pytest.param(Phase.SWITCHING, Phase.DRAINING, id="drain-while-switching"),
    ],
)
def test_illegal_edges_are_rejected(before: Phase, after: Phase) -> None:
    with pytest.raises(TransitionError):
        check_phase_edge(before, after)


def test_roles_by_kind() -> None:
    check_role(WorkerKind.ENGINE, Role.DECODE)
    check_role(WorkerKind.TRAINER, Role.IDLE)
    with pytest.raises(TransitionError, match="engine workers cannot take role train"):
        check_role(WorkerKind.ENGINE, Role.TRAIN)
    with pytest.raises(TransitionError):
        check_role(WorkerKind.TRAINER, Role.PREFILL)
    assert Role.IDLE in ROLES_BY_KIND[WorkerKind.ENGINE]


def test_role_changes_only_on_entry_into_switching() -> None:
    check_role_change(Phase.DRAINING, Phase.SWITCHING, Role.PREFILL, Role.DECODE)
    check_role_change(Phase.READY, Phase.SWITCHING, Role.IDLE, Role.DECODE)
    with pytest.raises(TransitionError):
        check_role_change(Phase.READY, Phase.READY, Role.PREFILL, Role.DECODE)
    with pytest.raises(TransitionError):
        check_role_change(Phase.SWITCHING, Phase.READY, Role.PREFILL, Role.DECODE)
