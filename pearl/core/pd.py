"""PD configurations: which engine instances (role, GPU type, TP degree) run, and how many.

A configuration is a multiset of ``InstanceSpec``. It is colocated when every instance is
``colocated`` and disaggregated when it holds prefill and decode instances. The GPU budget
says, per GPU type, how many GPUs each node offers to rollout, since an instance's GPUs
must sit on one node.

Invariants: counts are positive; ``PDConfig.instances`` is sorted, so two equal
configurations compare equal; a configuration read off a state counts every live engine
that is (or is becoming) active in an inference role.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from pearl.core.roles import Role
from pearl.core.state import ClusterState


class PDMode(StrEnum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"
    NONE = "none"  # no instance at all


@dataclass(frozen=True, order=True)
class InstanceSpec:
    role: Role
    gpu_type: str
    tp: int

    def label(self) -> str:
        return f"{self.role.value}:{self.gpu_type}x{self.tp}"


@dataclass(frozen=True, order=True)
class PDConfig:
    instances: tuple[tuple[InstanceSpec, int], ...] = ()

    @staticmethod
    def of(counts: Mapping[InstanceSpec, int] | Iterable[InstanceSpec]) -> PDConfig:
        c = counts if isinstance(counts, Mapping) else Counter(counts)
        return PDConfig(tuple(sorted((s, n) for s, n in c.items() if n > 0)))

    def counts(self) -> Counter[InstanceSpec]:
        return Counter(dict(self.instances))

    def count(self, role: Role) -> int:
        return sum(n for s, n in self.instances if s.role is role)

    @property
    def num_gpus(self) -> int:
        return sum(s.tp * n for s, n in self.instances)

    @property
    def mode(self) -> PDMode:
        if not self.instances:
            return PDMode.NONE
        if all(s.role is Role.COLOCATED for s, _ in self.instances):
            return PDMode.COLOCATED
        return PDMode.DISAGGREGATED

    def gpus_by_type(self) -> Counter[str]:
        c: Counter[str] = Counter()
        for s, n in self.instances:
            c[s.gpu_type] += s.tp * n
        return c

    def label(self) -> str:
        """Short human form, e.g. ``disaggregated 4P:12D [prefill:h100x2 x4, ...]``."""
        if self.mode is PDMode.DISAGGREGATED:
            head = f"disaggregated {self.count(Role.PREFILL)}P:{self.count(Role.DECODE)}D"
        else:
            head = f"{self.mode.value} {self.count(Role.COLOCATED)}C"
        body = ", ".join(f"{s.label()} x{n}" for s, n in self.instances)
        return f"{head} [{body}]"


@dataclass(frozen=True)
class GpuBudget:
    """GPUs available to rollout: per GPU type, the free GPU count of each node."""

    nodes: tuple[tuple[str, tuple[int, ...]], ...]

    @staticmethod
    def of(per_type: Mapping[str, Iterable[int]]) -> GpuBudget:
        return GpuBudget(
            tuple(sorted((t, tuple(sorted(ns, reverse=True))) for t, ns in per_type.items()))
        )

    def types(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self.nodes)

    def node_sizes(self, gpu_type: str) -> tuple[int, ...]:
        return next((ns for t, ns in self.nodes if t == gpu_type), ())

    def num_gpus(self, gpu_type: str | None = None) -> int:
        return sum(sum(ns) for t, ns in self.nodes if gpu_type in (None, t))


def fits(node_sizes: tuple[int, ...], tps: Iterable[int]) -> bool:
    """Whether instances of the given TP degrees pack onto the nodes.

    Largest degree first, best fit: the smallest node with room. Best fit keeps filling
    the node it chose until it is too small, so nodes of equal free size are filled as
    a group (cost independent of the instance count).
    """
    free = Counter(node_sizes)
    for tp, count in sorted(Counter(tps).items(), reverse=True):
        while count > 0:
            size = min((f for f, k in free.items() if k > 0 and f >= tp), default=None)
            if size is None:
                return False
            per_node = size // tp
            nodes = free.pop(size)
            full = min(nodes, count // per_node)
            count -= full * per_node
            free[size - per_node * tp] += full
            if full < nodes and count > 0:  # one node takes the rest
                free[size - count * tp] += 1
                count, full = 0, full + 1
            if nodes > full:
                free[size] += nodes - full
    return True


def fits_budget(config: PDConfig, budget: GpuBudget) -> bool:
    """Whether every instance of the configuration packs onto the budget's nodes."""
    for gpu_type in config.gpus_by_type():
        tps = [s.tp for s, n in config.instances if s.gpu_type == gpu_type for _ in range(n)]
        if not fits(budget.node_sizes(gpu_type), tps):
            return False
    return True


def config_of(state: ClusterState) -> PDConfig:
    """The PD configuration the live engines of a state serve or are becoming.

    Draining and stopping engines are on their way out of their role and do not count.
    """
    counts = state.serving_engine_counts
    return PDConfig.of({InstanceSpec(r, t, tp): n for (r, t, tp), n in counts.items()})
