"""``pearl.run.elastic``: elastic slots on the shipped availability schedule, compressed."""

from __future__ import annotations

from dataclasses import dataclass, field

from pearl.core.decision import ElasticRequest
from pearl.core.observation import (
    AllocationEnded,
    AllocationGranted,
    AllocationPending,
    AllocationPreempting,
    Event,
    GrantedNode,
)
from pearl.core.state import EndReason
from pearl.run.elastic import ScheduledBackend, compressed_windows

REQ = ElasticRequest(1, "cpu", "elastic", 60)


@dataclass
class GrantAtOnce:
    """A backend that grants every submission at its next poll (LocalBackend's way)."""

    new: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    def submit(self, request: ElasticRequest, allocation_id: str) -> None:
        self.new.append(allocation_id)

    def poll(self, now_s: float) -> list[Event]:
        out: list[Event] = [
            AllocationGranted(
                allocation_id=a, nodes=(GrantedNode(node="localhost", gpu_type="cpu", num_gpus=1),)
            )
            for a in self.new
        ]
        out += [AllocationEnded(allocation_id=a, reason=EndReason.RELEASED) for a in self.released]
        self.new, self.released = [], []
        return out

    def reattach(self, request: ElasticRequest, allocation_id: str) -> bool:
        return False

    def release(self, allocation_id: str) -> None:
        self.released.append(allocation_id)

    def job_id(self, allocation_id: str) -> str:
        return allocation_id

    def close(self) -> None:
        return None


def test_the_shipped_windows_compressed_start_at_zero_and_keep_their_order() -> None:
    spans = compressed_windows(1000.0, min_duration_s=5.0)
    assert spans[0][0] == 0.0 and len(spans) > 3
    assert all(b - a >= 5.0 for a, b in spans) and spans == tuple(sorted(spans))
    assert len(compressed_windows(1000.0)) >= len(spans)


def test_a_request_waits_for_a_window_is_granted_to_its_end_then_preempted() -> None:
    inner = GrantAtOnce()
    b = ScheduledBackend(inner, ((10.0, 20.0),), grace_s=2.0)
    b.submit(REQ, "el0001")
    (pending,) = b.poll(5.0)
    assert isinstance(pending, AllocationPending) and inner.new == []
    (granted,) = b.poll(10.0)  # submitted to the inner backend, granted at once
    assert isinstance(granted, AllocationGranted) and granted.end_by_s == 20.0
    assert b.poll(15.0) == []
    (preempting,) = b.poll(20.0)
    assert isinstance(preempting, AllocationPreempting) and preempting.deadline_s == 22.0
    (ended,) = b.poll(22.5)
    assert isinstance(ended, AllocationEnded) and ended.reason is EndReason.PREEMPTED
    assert inner.released == ["el0001"]
    assert b.poll(23.0) == []  # the inner backend's own end of it is not reported again


def test_a_release_ends_it_as_released() -> None:
    inner = GrantAtOnce()
    b = ScheduledBackend(inner, ((0.0, 100.0),))
    b.submit(REQ, "el0001")
    b.poll(1.0)
    b.poll(2.0)
    b.release("el0001")
    (ended,) = b.poll(3.0)
    assert isinstance(ended, AllocationEnded) and ended.reason is EndReason.RELEASED
    b.submit(REQ, "el0002")
    b.release("el0002")  # still waiting: nothing to give back
    assert b.poll(4.0) == [] and inner.new == []
