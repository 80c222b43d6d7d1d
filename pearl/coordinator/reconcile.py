"""What the node agents report, folded into the coordinator's observations (pure).

Three rules keep the state true to what runs on the nodes:

- ``lost_workers``: an agent that dies (heartbeat timeout, its job gone) or leaves (``Bye``,
  after a preemption) takes its node's workers with it; an agent that (re)joins reports
  the workers it runs, and every worker the state places on its node that it does not
  report is gone (after a restart, the agent's or the coordinator's, the engines were
  stopped). Either way the state drops them (``WorkersLost``) and their GPUs are free for
  the next plan. An agent that reports workers that died by themselves (``exited``: an
  engine killed or crashed) takes those out the same way.
- an agent that reports a preemption (Slurm's signal reached it before the backend's next
  poll saw the moved end time) makes its allocation ``preempting`` now, with the agent's
  grace period as the deadline: the core moves work off it without waiting for the poll.
- ``GrantGate``: Slurm's grant is not yet a usable allocation; its GPUs are usable once an
  agent on each of its nodes has joined. Until then the grant is held back, so no plan is
  made for nodes nobody can act on. A grant whose agents do not all join within
  ``join_timeout_s`` is given up: the caller releases the allocation, and the core sees it
  end (reason ``no agent``). A grant that is taken back (preempted or ended) before its
  agents joined is dropped; its other events pass.
- ``suspended_grants``: a resumed incarnation's granted elastic allocations wait for their
  agents again (their engines died with the last incarnation: an agent stops its engines
  when the run stops or goes silent). Each goes back to pending in the state, without its
  GPUs and the workers on them, and its grant is held by the gate as a new one is: its
  GPUs come back once its agents have rejoined, and an allocation whose agents never do
  is given up after ``join_timeout_s``, instead of plans failing on its nodes.

No I/O and no clock: the run clock comes in as ``now_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pearl.core.observation import (
    AllocationEnded,
    AllocationGranted,
    AllocationPreempting,
    Event,
    GrantedNode,
    WorkersLost,
)
from pearl.core.state import AllocationKind, AllocationStatus, ClusterState, EndReason

LEFT = frozenset({"dead", "gone"})


@dataclass(frozen=True)
class AgentEvent:
    """One thing that happened to an agent: ``kind`` is joined, preempted, exited, gone,
    dead or refused; ``workers`` are those it reported when it joined (those that died, for
    ``exited``)."""

    kind: str
    agent_id: str
    node: str
    detail: str = ""
    workers: tuple[str, ...] = ()
    grace_s: float | None = None  # of a preemption
    job_id: str | None = None  # the scheduler's job it runs in, if it said


def agent_observations(
    state: ClusterState,
    events: Iterable[AgentEvent],
    now_s: float,
    job_of: Callable[[str], str | None] = lambda aid: None,
) -> list[Event]:
    """``WorkersLost`` for the workers on the nodes of agents that left or rejoined
    without them, each worker at most once; ``AllocationPreempting`` for the elastic
    allocation of an agent that reports a preemption."""
    out: list[Event] = []
    seen: set[str] = set()
    for ev in events:
        if ev.kind == "preempted":
            out += _preempting(state, ev, now_s, job_of)
            continue
        if ev.kind in LEFT:
            keep: frozenset[str] = frozenset()
            reason = f"agent {ev.agent_id} {ev.kind}: {ev.detail}"
        elif ev.kind == "joined":
            keep = frozenset(ev.workers)
            reason = f"agent {ev.agent_id} joined without them"
        elif ev.kind == "exited":
            died = frozenset(ev.workers)
            keep = frozenset(w.worker_id for w in state.workers if w.worker_id not in died)
            reason = f"exited on {ev.node}: {ev.detail}"
        else:
            continue
        gone = tuple(
            w.worker_id
            for w in state.workers
            if w.node == ev.node and w.worker_id not in keep and w.worker_id not in seen
        )
        if gone:
            seen.update(gone)
            out.append(WorkersLost(worker_ids=gone, reason=reason))
    return out


def _preempting(
    state: ClusterState, ev: AgentEvent, now_s: float, job_of: Callable[[str], str | None]
) -> list[Event]:
    """The granted elastic allocations on the agent's node, and in its job where both the
    agent and the backend know the job."""
    allocations = state.allocation_by_id

    def ours(aid: str) -> bool:
        a = allocations.get(aid)
        if a is None or a.kind is not AllocationKind.ELASTIC:
            return False
        return a.status is AllocationStatus.GRANTED and _same_job(ev.job_id, job_of(aid))

    on_node = {g.allocation_id for g in state.gpus if g.node == ev.node}
    ids = sorted(aid for aid in on_node if ours(aid))
    deadline_s = now_s + (ev.grace_s or 0.0)
    return [AllocationPreempting(allocation_id=aid, deadline_s=deadline_s) for aid in ids]


def _same_job(agent_job: str | None, allocation_job: str | None) -> bool:
    """Whether an agent runs in an allocation's job, as far as both are known."""
    return agent_job is None or allocation_job is None or agent_job == allocation_job


@dataclass(frozen=True)
class LiveAgent:
    node: str
    job_id: str | None = None  # the Slurm job it runs in, if any


@dataclass
class _Held:
    grant: AllocationGranted
    since_s: float


class GrantGate:
    def __init__(self, join_timeout_s: float) -> None:
        self.join_timeout_s = join_timeout_s
        self._held: dict[str, _Held] = {}

    @property
    def held(self) -> tuple[str, ...]:
        """Allocations granted by Slurm whose agents have not all joined yet."""
        return tuple(self._held)

    def filter(
        self,
        events: Sequence[Event],
        agents: Iterable[LiveAgent],
        now_s: float,
        job_of: Callable[[str], str | None] = lambda aid: None,
    ) -> tuple[list[Event], list[str]]:
        """The events to observe now, and the allocations to release (no agent in time).

        An agent counts for a node of a grant when it runs there and, where both are
        known, in the grant's Slurm job (``job_of``): a node granted again does not
        count the agent of its previous allocation, still alive until its heartbeats
        stop."""
        live = list(agents)

        def covered(node: str, job: str | None) -> bool:
            return any(a.node == node and _same_job(a.job_id, job) for a in live)

        out: list[Event] = []
        for ev in events:
            if isinstance(ev, AllocationGranted):
                self._held.setdefault(ev.allocation_id, _Held(ev, now_s))
                continue
            if isinstance(ev, AllocationPreempting | AllocationEnded):
                self._held.pop(ev.allocation_id, None)
            out.append(ev)
        give_up: list[str] = []
        for aid, h in list(self._held.items()):
            job = job_of(aid)
            if all(covered(n.node, job) for n in h.grant.nodes):
                out.append(h.grant)
                del self._held[aid]
            elif now_s - h.since_s > self.join_timeout_s:
                give_up.append(aid)
                out.append(AllocationEnded(allocation_id=aid, reason=EndReason.NO_AGENT))
                del self._held[aid]
        return out, give_up

    def drop(self, allocation_id: str) -> None:
        """Forget a held grant (its allocation is gone)."""
        self._held.pop(allocation_id, None)

    def hold(self, grants: Iterable[AllocationGranted], now_s: float) -> None:
        """Hold ``grants`` from ``now_s`` on, as if Slurm had just granted them."""
        for grant in grants:
            self._held.setdefault(grant.allocation_id, _Held(grant, now_s))


def suspended_grants(state: ClusterState) -> tuple[ClusterState, list[AllocationGranted]]:
    """``state`` with its granted elastic allocations back to pending (their GPUs, and the
    workers on them, gone), and the grant of each, to be held until its agents rejoin."""
    allocations = state.allocation_by_id
    suspended = {
        a.allocation_id
        for a in state.allocations
        if a.kind is AllocationKind.ELASTIC and a.status is AllocationStatus.GRANTED
    }
    if not suspended:
        return state, []
    grants = []
    for aid in sorted(suspended):
        per_node: dict[tuple[str, str], int] = {}
        for g in state.gpus:
            if g.allocation_id == aid:
                per_node[g.node, g.gpu_type] = per_node.get((g.node, g.gpu_type), 0) + 1
        nodes = tuple(
            GrantedNode(node=n, gpu_type=t, num_gpus=k) for (n, t), k in sorted(per_node.items())
        )
        if nodes:
            end_by_s = allocations[aid].end_by_s
            grants.append(AllocationGranted(allocation_id=aid, nodes=nodes, end_by_s=end_by_s))
    gone = {g.gpu_id for g in state.gpus if g.allocation_id in suspended}
    pending = AllocationStatus.PENDING
    return (
        state.replace(
            allocations=tuple(
                a.model_copy(update={"status": pending}) if a.allocation_id in suspended else a
                for a in state.allocations
            ),
            gpus=tuple(g for g in state.gpus if g.gpu_id not in gone),
            workers=tuple(w for w in state.workers if not gone.intersection(w.gpu_ids)),
        ),
        grants,
    )
