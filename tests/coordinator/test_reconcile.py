"""Agents' reports folded into observations: lost workers, preemptions reported by an
agent, and grants held for agents."""

from __future__ import annotations

from pearl.bench.synth import Layout, build_state
from pearl.coordinator.reconcile import (
    AgentEvent,
    GrantGate,
    LiveAgent,
    agent_observations,
    suspended_grants,
)
from pearl.core.observation import (
    AllocationEnded,
    AllocationGranted,
    AllocationPending,
    AllocationPreempting,
    GrantedNode,
    Observation,
    WorkersLost,
    observe,
)


def _grant(aid: str, *nodes: str) -> AllocationGranted:
    return AllocationGranted(
        allocation_id=aid,
        nodes=tuple(GrantedNode(node=n, gpu_type="h20", num_gpus=2) for n in nodes),
    )


def test_an_agent_that_leaves_takes_its_nodes_workers() -> None:
    state = build_state(Layout(1, 2, 0))
    node = state.workers[-1].node
    on_node = {w.worker_id for w in state.workers if w.node == node}
    events = [
        AgentEvent("joined", "a9", "elsewhere"),  # no worker there: nothing lost
        AgentEvent("preempted", "a1", node, "grace 5 s"),  # not gone yet
        AgentEvent("dead", "a1", node, "no heartbeat for 3.1 s"),
        AgentEvent("gone", "a1", node, "bye"),  # the same workers are not lost twice
    ]
    (lost,) = agent_observations(state, events, 10.0)  # base nodes: no preemption
    assert isinstance(lost, WorkersLost)
    assert set(lost.worker_ids) == on_node and "a1 dead: no heartbeat" in lost.reason


def test_an_agent_that_rejoins_keeps_only_the_workers_it_reports() -> None:
    state = build_state(Layout(1, 2, 0))
    node = state.workers[-1].node
    on_node = sorted(w.worker_id for w in state.workers if w.node == node)
    assert len(on_node) >= 2
    joined = AgentEvent("joined", "a2", node, workers=(on_node[0],))
    (lost,) = agent_observations(state, [joined], 10.0)
    assert isinstance(lost, WorkersLost) and list(lost.worker_ids) == on_node[1:]
    again = AgentEvent("joined", "a2", node, workers=tuple(on_node))
    assert agent_observations(state, [again], 10.0) == []


def test_workers_an_agent_reports_exited_are_lost_and_only_those_on_its_node() -> None:
    state = build_state(Layout(2, 2, 0))
    node = state.workers[-1].node
    on_node = sorted(w.worker_id for w in state.workers if w.node == node)
    elsewhere = next(w.worker_id for w in state.workers if w.node != node)
    died = (on_node[0], elsewhere, "never-existed")
    ev = AgentEvent("exited", "a1", node, f"{on_node[0]} (-9)", workers=died)
    (lost,) = agent_observations(state, [ev, ev], 10.0)  # the same report twice: once
    assert isinstance(lost, WorkersLost) and lost.worker_ids == (on_node[0],)
    assert lost.reason == f"exited on {node}: {on_node[0]} (-9)"
    assert on_node[0] not in observe(state, Observation(events=(lost,)), 10.0).worker_by_id


def test_an_agent_that_reports_a_preemption_makes_its_allocation_preempting() -> None:
    state = build_state(Layout(1, 1, 1))
    (node,) = {g.node for g in state.gpus if g.allocation_id == "el0000"}
    ev = AgentEvent("preempted", "a3", node, "grace 5.0 s", grace_s=5.0)
    assert agent_observations(state, [ev], 10.0) == [
        AllocationPreempting(allocation_id="el0000", deadline_s=15.0)
    ]
    # the agent of another job on that node (the allocation's job is 7): not this one
    other = AgentEvent("preempted", "a4", node, grace_s=5.0, job_id="6")
    assert agent_observations(state, [other], 10.0, {"el0000": "7"}.get) == []
    # the job leaves within its grace period and Slurm says "completed": a preemption
    preempting = observe(state, Observation(events=tuple(agent_observations(state, [ev], 10))), 10)
    for slurm_says, reason in (("completed", "preempted"), ("released", "released")):
        end = AllocationEnded(allocation_id="el0000", reason=slurm_says)
        after = observe(preempting, Observation(events=(end,)), 12.0)
        assert after.allocation_by_id["el0000"].end_reason == reason
    end = AllocationEnded(allocation_id="el0000", reason="completed")  # not preempting
    assert (
        observe(state, Observation(events=(end,)), 12.0).allocation_by_id["el0000"].end_reason
        == "completed"
    )


def test_a_grant_waits_for_an_agent_on_each_of_its_nodes() -> None:
    gate = GrantGate(join_timeout_s=60.0)
    pending = AllocationPending(allocation_id="el1", gpu_type="h20", num_gpus=4)
    grant = _grant("el1", "h20-1", "h20-2")
    out, give_up = gate.filter([pending, grant], [], 10.0)
    assert out == [pending] and give_up == [] and gate.held == ("el1",)
    out, _ = gate.filter([], [LiveAgent("h20-1")], 20.0)  # one of two nodes: still held
    assert out == [] and gate.held == ("el1",)
    out, _ = gate.filter([], [LiveAgent("h20-1"), LiveAgent("h20-2")], 30.0)
    assert out == [grant] and gate.held == ()


def test_a_grant_without_agents_is_given_up_and_one_taken_back_is_dropped() -> None:
    gate = GrantGate(join_timeout_s=60.0)
    gate.filter([_grant("el1", "h20-1"), _grant("el2", "h20-2")], [], 0.0)
    out, give_up = gate.filter([], [], 60.0)  # not more than the timeout yet
    assert out == [] and give_up == []
    taken = AllocationPreempting(allocation_id="el2", deadline_s=70.0)
    out, give_up = gate.filter([taken], [], 60.5)
    assert give_up == ["el1"]
    assert out == [taken, AllocationEnded(allocation_id="el1", reason="no agent")]
    assert gate.held == ()


def test_the_agent_of_a_nodes_previous_job_does_not_count_for_its_next_grant() -> None:
    gate = GrantGate(join_timeout_s=60.0)
    jobs = {"el2": "102"}
    stale = LiveAgent("h20-1", "101")  # el1's agent, alive until its heartbeats stop
    out, _ = gate.filter([_grant("el2", "h20-1")], [stale], 0.0, jobs.get)
    assert out == [] and gate.held == ("el2",)
    out, _ = gate.filter([], [stale, LiveAgent("h20-1", "102")], 1.0, jobs.get)
    assert [e.allocation_id for e in out] == ["el2"]  # type: ignore[union-attr]


def test_a_resumed_grant_waits_for_its_agents_again_and_comes_back_whole() -> None:
    from pearl.core.state import AllocationStatus

    state = build_state(Layout(1, 1, 1))  # el0000 granted, with workers on its GPUs
    mine = {g.gpu_id for g in state.gpus if g.allocation_id == "el0000"}
    assert mine and any(mine.intersection(w.gpu_ids) for w in state.workers)
    held, grants = suspended_grants(state)
    assert held.allocation_by_id["el0000"].status is AllocationStatus.PENDING
    assert not mine & set(held.gpu_by_id)
    assert not any(mine.intersection(w.gpu_ids) for w in held.workers)
    assert len(held.workers) < len(state.workers) and len(held.gpus) == len(state.gpus) - len(mine)
    (grant,) = grants
    gate = GrantGate(join_timeout_s=30.0)
    gate.hold(grants, 100.0)
    (node,) = {n.node for n in grant.nodes}
    assert gate.filter([], [], 110.0) == ([], [])  # no agent yet: still held
    out, give_up = gate.filter([], [LiveAgent(node)], 111.0)
    assert out == [grant] and give_up == []
    back = observe(held, Observation(events=tuple(out)), 111.0)
    assert {g.gpu_id for g in back.gpus if g.allocation_id == "el0000"} == mine
    assert back.allocation_by_id["el0000"].status is AllocationStatus.GRANTED
    gate.hold(grants, 100.0)  # an agent that never rejoins: given up after the timeout
    out, give_up = gate.filter([], [], 131.0)
    assert give_up == ["el0000"] and out == [
        AllocationEnded(allocation_id="el0000", reason="no agent")
    ]
    assert suspended_grants(build_state(Layout(1, 1, 0))) == (build_state(Layout(1, 1, 0)), [])


def test_a_held_grant_of_an_allocation_found_lost_does_not_revive_it() -> None:
    from pearl.core.state import AllocationStatus

    held, grants = suspended_grants(build_state(Layout(1, 1, 1)))
    gate = GrantGate(join_timeout_s=30.0)
    gate.hold(grants, 100.0)
    gate.drop("el0000")  # the coordinator's reattach found the job gone
    (node,) = {n.node for n in grants[0].nodes}
    assert gate.filter([], [LiveAgent(node)], 101.0) == ([], [])
    lost = AllocationEnded(allocation_id="el0000", reason="lost")
    after = observe(held, Observation(events=(lost, grants[0])), 101.0)  # a late grant too
    assert after.allocation_by_id["el0000"].status is AllocationStatus.ENDED
    assert not [g for g in after.gpus if g.allocation_id == "el0000"]
