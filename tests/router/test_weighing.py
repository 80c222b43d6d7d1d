"""The HTTP router weighs unequal instances by their speed, as the simulator's fleet does.

The plan step that starts (or wakes) an engine names its GPU type and TP degree; with a
runtime profile the router weighs its load by the busy time per turn of the traffic's mean
shape on the profile's engine for them (``pearl.serving.routing.turn_work_s``).
No engine is contacted here: routing is ``Router._choose`` over the table, each chosen
turn booked in flight as ``Router._send`` books it.
"""

from __future__ import annotations

import asyncio

import pytest

from pearl.core.plan import Action
from pearl.core.profile import RuntimeProfile, WorkloadDefaults
from pearl.core.roles import Role
from pearl.io.documents import load_profile
from pearl.router.instances import InFlight
from pearl.router.plan_steps import PlanSteps
from pearl.router.router import Router
from pearl.serving.routing import kv_slots, mean_context_tokens, turn_work_s
from pearl.serving.traffic import MIN_SAMPLES, TrafficMeans

PROMPT_TOKENS = 1749


@pytest.fixture(scope="module")
def qwen8b() -> RuntimeProfile:
    return load_profile("qwen3-8b")


def _fleet(router: Router) -> PlanSteps:
    """Four H20 instances of one GPU and one H800 instance of four, started by plan steps."""
    steps = PlanSteps(router)
    for i in range(4):
        steps.end(Action.START, f"h20-{i}", Role.COLOCATED, f"http://h20-{i}:1", True, "h20", 1)
    steps.end(Action.START, "h800-0", Role.COLOCATED, "http://h800-0:1", True, "h800", 4)
    return steps


def _first_turns(router: Router, n: int) -> dict[str, int]:
    for i in range(n):
        inst = router._choose(f"t{i}", PROMPT_TOKENS, set())
        assert inst is not None
        inst.sent(InFlight(f"t{i}-0", f"t{i}", PROMPT_TOKENS, 0))
    return {inst.worker_id: inst.load for inst in router.table}


def test_first_turns_go_to_unequal_instances_in_proportion_to_their_speed(
    qwen8b: RuntimeProfile,
) -> None:
    """By counts alone the H800 instance took a fifth of the new trajectories; weighed,
    it takes its speed's share, as the simulator's fleet gives it
    (``tests/sim/test_fleet_routing.py``)."""
    router = Router(profile=qwen8b)
    _fleet(router)
    big = router.table.get("h800-0")
    small = router.table.get("h20-0")
    assert (big.gpu_type, big.tp, small.gpu_type, small.tp) == ("h800", 4, "h20", 1)
    assert big.turn_s is not None and small.turn_s is not None
    assert small.turn_s > 3 * big.turn_s
    loads = _first_turns(router, 100)
    h20 = [loads[f"h20-{i}"] for i in range(4)]
    assert sum(h20) + loads["h800-0"] == 100
    assert loads["h800-0"] > 3 * max(h20)
    assert loads["h800-0"] == pytest.approx(small.turn_s / big.turn_s * h20[0], rel=0.15)


def test_without_a_profile_loads_compare_as_counts(qwen8b: RuntimeProfile) -> None:
    router = Router()
    _fleet(router)
    assert all(inst.turn_s is None for inst in router.table)
    assert set(_first_turns(router, 100).values()) == {20}


def test_an_instance_the_profile_cannot_weigh_makes_every_load_a_count(
    qwen8b: RuntimeProfile,
) -> None:
    """A GPU type the profile has no engine for: no instance is weighed (a count beside
    a time would starve the one or the others), until it leaves."""
    router = Router(profile=qwen8b)
    steps = _fleet(router)
    steps.end(Action.START, "x-0", Role.COLOCATED, "http://x-0:1", True, "x9000", 1)
    assert all(inst.turn_s is None for inst in router.table)
    assert set(_first_turns(router, 60).values()) == {10}
    steps.lost(["x-0"])
    assert all(inst.turn_s is not None for inst in router.table)


def test_a_role_switch_weighs_the_instance_for_its_new_role(qwen8b: RuntimeProfile) -> None:
    router = Router(profile=qwen8b)
    steps = _fleet(router)
    colocated_s = router.table.get("h800-0").turn_s

    async def switch() -> None:  # a switch's start sends its aborts on the router's loop
        steps.start(Action.SWITCH, "h800-0")
        await steps.settle()
        steps.end(Action.SWITCH, "h800-0", Role.DECODE)

    asyncio.run(switch())
    inst = router.table.get("h800-0")
    engine = qwen8b.engine("h800", 4)
    workload = router.workload()
    assert inst.role is Role.DECODE and engine is not None and workload is not None
    kv = kv_slots(qwen8b.kv_capacity_tokens("h800", 4), mean_context_tokens(workload))
    assert inst.turn_s == turn_work_s(engine, Role.DECODE, workload, kv)
    assert inst.turn_s != colocated_s


def test_the_traffic_means_replace_the_prior_once_enough_turns_are_seen() -> None:
    prior = WorkloadDefaults(
        prompt_tokens=1000.0,
        output_tokens_per_turn=100.0,
        observation_tokens_per_turn=50.0,
        env_latency_s=2.0,
        turns_per_trajectory=4.0,
    )
    traffic = TrafficMeans()
    assert traffic.workload(prior) == prior
    for _ in range(MIN_SAMPLES):
        traffic.turn_routed(5000, None)  # a first turn
        traffic.turn_finished(300)
        traffic.turn_routed(5000 + 300 + 700, 5000 + 300)  # its second: 700 appended
        traffic.turn_finished(300)
    got = traffic.workload(prior)
    assert got == WorkloadDefaults(
        prompt_tokens=5000.0,
        output_tokens_per_turn=300.0,
        observation_tokens_per_turn=700.0,
        env_latency_s=2.0,  # the router never sees the environment
        turns_per_trajectory=2.0,
    )
    one_short = TrafficMeans()
    for _ in range(MIN_SAMPLES - 1):
        one_short.turn_routed(5000, None)
    assert one_short.workload(prior).prompt_tokens == 1000.0
