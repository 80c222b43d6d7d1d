"""The simulator's fleet routes with pearl.serving's rules: the views it builds, the home
it records, and what a queue does to a returning turn."""

from __future__ import annotations

from functools import cache

import pytest
import sim_fixtures as F

from pearl.core.profile import RuntimeProfile
from pearl.core.roles import Role
from pearl.io.documents import load_profile
from pearl.serving.requests import Request
from pearl.serving.views import InstanceLoad
from pearl.sim.fleet import Fleet


@cache
def profile() -> RuntimeProfile:
    return load_profile("qwen3-8b")


def fleet(*roles: Role) -> Fleet:
    f = Fleet(profile())
    for i, role in enumerate(roles):
        f.add(f"w{i}", role, "h20", "n0", 1, 0)
    return f


def queue_fresh_prompts(f: Fleet, worker_id: str, n: int, tokens: int = 5330) -> None:
    """``n`` more first turns of other trajectories waiting on the instance."""
    engine = f.instances[worker_id].engine
    for _ in range(n):
        i = engine.num_requests
        engine.submit(Request(f"o{i}.0.1", f"o{i}", tokens, 100))


def test_a_turn_records_its_home_and_the_prefix_it_leaves_there() -> None:
    f = fleet(Role.COLOCATED, Role.COLOCATED)
    inst = f.route(Request("t.0.1", "t", 5330, 262))
    assert inst is not None and inst.worker_id == "w0"  # tie: the smaller worker id
    home = f.affinity["t"]
    assert home.instance is inst and home.prefix_tokens == 5330 + 262
    assert f.queue("w0").batch_seqs == 0  # routed, not yet expected there: nothing counted
    f.expect(inst, "t.0.1", 1.0)
    assert f.queue("w0").batch_seqs == 1 and inst.load == 1
    pd = fleet(Role.PREFILL, Role.DECODE)
    pf = pd.route(Request("t.0.1", "t", 5330, 262))
    assert pf is not None and pf.role is Role.PREFILL
    assert pd.affinity["t"].prefix_tokens == 5330  # a prefill instance never sees the output
    decode = pd.route_decode()
    assert decode is not None and decode.worker_id == "w1"


def test_a_returning_turn_stays_behind_a_short_queue_and_leaves_a_long_one() -> None:
    f = fleet(Role.COLOCATED, Role.COLOCATED)
    f.route(Request("t.0.1", "t", 5330, 262))
    second = Request("t.1.2", "t", 5330 + 262 + 614, 262)
    queue_fresh_prompts(f, "w0", 1, tokens=900)  # the old rule left whenever anything queued
    inst = f.route(second)
    assert inst is not None and inst.worker_id == "w0"
    queue_fresh_prompts(f, "w0", 6)
    inst = f.route(second)
    assert inst is not None and inst.worker_id == "w1"
    assert f.affinity["t"].instance is inst  # the new home


def test_an_instance_that_left_is_no_home_even_under_the_same_worker_id() -> None:
    f = fleet(Role.COLOCATED, Role.COLOCATED)
    f.route(Request("t.0.1", "t", 5330, 262))
    f.remove("w0")
    f.add("w0", Role.COLOCATED, "h20", "n0", 1, 1)  # a switch: a new engine, no cache
    queue_fresh_prompts(f, "w0", 1, tokens=900)  # short enough for a home to keep the turn
    inst = f.route(Request("t.1.2", "t", 5330 + 262 + 614, 262))
    assert inst is not None and inst.worker_id == "w1"


def test_the_expected_output_is_the_mean_of_the_finished_requests() -> None:
    f = fleet(Role.COLOCATED)
    assert f.expected_output_tokens == profile().workload.output_tokens_per_turn
    inst = f.instances["w0"]
    inst.engine.submit(Request("a.0.1", "a", 100, 10))
    inst.engine.submit(Request("b.0.1", "b", 100, 30))
    while f.finished_requests < 2:
        f.start_step(inst, 0.0, float("inf"))
        f.end_step(inst)
    assert f.expected_output_tokens == 20.0


def test_a_draining_home_sends_its_turns_elsewhere_and_no_entry_parks_them() -> None:
    f = fleet(Role.COLOCATED, Role.COLOCATED)
    f.route(Request("t.0.1", "t", 5330, 262))
    f.stop_accepting("w0")
    inst = f.route(Request("t.1.2", "t", 6206, 262))
    assert inst is not None and inst.worker_id == "w1"
    f.stop_accepting("w1")
    assert f.route(Request("t.1.3", "t", 6206, 262)) is None
    assert f.route_decode() is None


@pytest.mark.parametrize(
    "policy", [pytest.param("pearl", id="pearl"), pytest.param("static-pd-disaggregated", id="pd")]
)
def test_the_load_index_is_the_scan_at_every_route_of_a_run(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a run with joins, drains, take-offs and PD handoffs, the fleet's index of
    loads names the instance ``routing.least_loaded``'s scan of its candidates names."""
    checked = [0, 0]
    kept = Fleet.loads

    class Checked:
        def __init__(self, f: Fleet) -> None:
            self.fleet, self.index = f, kept(f)

        def least_loaded_entry(self) -> InstanceLoad | None:
            got = self.index.least_loaded_entry()
            assert got is self.fleet.candidates().least_loaded_entry()
            checked[0] += 1
            return got

        def least_loaded_decode(self) -> InstanceLoad | None:
            got = self.index.least_loaded_decode()
            assert got is self.fleet.candidates().least_loaded_decode()
            checked[1] += 1
            return got

    monkeypatch.setattr(Fleet, "loads", lambda f: Checked(f))
    F.run(F.busy_inputs(0, F.RULES[1]), policy)
    assert checked[0] > 100
    assert policy == "pearl" or checked[1] > 100


def test_first_turns_go_to_instances_in_proportion_to_their_speed() -> None:
    """Four H20 instances and one of four H800s: the fleet weighs each instance's load by
    its busy time per turn (``routing.turn_work_s``), so the H800 instance takes several
    times an H20's share of new trajectories (by counts alone it took a fifth)."""
    f = Fleet(profile())
    for i in range(4):
        f.add(f"h20-{i}", Role.COLOCATED, "h20", "n0", 1, 0)
    big = f.add("h800-0", Role.COLOCATED, "h800", "n1", 4, 0)
    for i in range(100):
        inst = f.route(Request(f"t{i}.0.1", f"t{i}", 1749, 194))
        assert inst is not None
        f.expect(inst, f"t{i}.0.1", 1.0)
    small = [f.instances[f"h20-{i}"].load for i in range(4)]
    assert sum(small) + big.load == 100
    assert big.load > 3 * max(small)
    ratio = f.instances["h20-0"].turn_s / big.turn_s
    assert big.load == pytest.approx(ratio * small[0], rel=0.15)
