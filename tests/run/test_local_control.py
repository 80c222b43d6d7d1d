"""``pearl.run.control``: the coordinator's control plane on one machine.

Without engines: the local server's dependency walk, failures and timeouts (fake
workers), the trainer's slot and status, the cores per slot. With two real reference
engines: a hand-made plan (start, drain, switch, sync the trainer's weights, offload and
onload the trainer, stop) carried out, the router's table following each step."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pearl.control.messages import Command
from pearl.control.workers import WorkerError
from pearl.core.observation import TrainerPhase
from pearl.core.pd import PDConfig
from pearl.core.plan import Action, PlanStep, Target, TransitionPlan
from pearl.core.roles import Role
from pearl.run.config import RunConfig
from pearl.run.control import (
    LocalControl,
    LocalEngines,
    LocalServer,
    RouterListener,
    TrainerSlot,
    TrainerSource,
    TrainerWorkers,
    slot_cores,
)
from pearl.run.engine_command import engine_template
from pearl.trainer.remote import TrainerLost

NODE = "localhost"


def step(
    sid: int,
    action: Action,
    worker: str,
    role: Role | None = None,
    deps: tuple[int, ...] = (),
    gpus: tuple[str, ...] = ("localhost/0",),
    duration_s: float = 1.0,
) -> PlanStep:
    return PlanStep(sid, action, worker, NODE, gpus, role, deps, duration_s, 0.0, "test")


def plan(*steps: PlanStep) -> TransitionPlan:
    return TransitionPlan(Target(PDConfig()), tuple(steps))


@dataclass
class FakeWorkers:
    fail: set[str] = field(default_factory=set)
    slow_s: dict[str, float] = field(default_factory=dict)
    done: list[tuple[str, str]] = field(default_factory=list)

    def execute(self, cmd: Command) -> None:
        time.sleep(self.slow_s.get(cmd.worker_id, 0.0))
        if cmd.worker_id in self.fail:
            raise WorkerError(f"{cmd.worker_id} broke")
        self.done.append((cmd.action.value, cmd.worker_id))

    def stop_all(self, budget_s: float) -> None:
        return None

    def worker_ids(self) -> tuple[str, ...]:
        return tuple(w for a, w in self.done if a == "start")

    def engine_url(self, worker_id: str) -> str | None:
        return f"http://{worker_id}"

    def exited(self) -> dict[str, int]:
        return {}


class FakeTrainer:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def offload(self) -> None:
        self.calls.append("offload")

    def onload(self) -> None:
        self.calls.append("onload")


def control(engines: FakeWorkers, trainer: FakeTrainer | None = None) -> LocalControl:
    slot = TrainerSlot(trainer or FakeTrainer())
    return LocalControl(LocalServer([NODE], engines, TrainerWorkers(slot)), min_deadline_s=0.5)


def test_steps_run_by_their_dependencies_and_a_failure_aborts_what_waits_on_it() -> None:
    engines = FakeWorkers(fail={"e1"})
    trainer = FakeTrainer()
    c = control(engines, trainer)
    out = c.execute(
        plan(
            step(0, Action.START, "e0", Role.COLOCATED),
            step(1, Action.START, "e1", Role.COLOCATED),
            step(2, Action.SYNC_WEIGHTS, "e0", deps=(0,)),
            step(3, Action.STOP, "e1", deps=(1,)),
            step(4, Action.OFFLOAD, "t0", Role.IDLE, gpus=("trainer/0",)),
        )
    )
    assert not out.ok
    assert out.carried_out == {0, 2, 4}
    assert ("start", "e0") in engines.done and ("sync_weights", "e0") in engines.done
    assert trainer.calls == ["offload"]
    assert "e1 broke" in out.error
    ended = {s.step_id: s for s in out.steps}
    assert not ended[3].ok and "dependency 1" in ended[3].error
    c.close()


def test_agents_join_once_keeping_the_trainers_workers_only() -> None:
    slot = TrainerSlot(FakeTrainer())
    c = LocalControl(LocalServer([NODE, "trainer"], FakeWorkers(), TrainerWorkers(slot, ("t0",))))
    joined = c.events()
    assert [(e.kind, e.node, e.workers) for e in joined] == [
        ("joined", NODE, ("t0",)),
        ("joined", "trainer", ("t0",)),
    ]
    assert c.events() == []
    assert {a["node"] for a in c.agents()} == {NODE, "trainer"}
    c.close()


def test_agents_join_with_the_engines_started_before_the_first_decision() -> None:
    """The asleep engines pearl run starts on the trainer's slots before the coordinator
    opens are this incarnation's: the agents join with them (others would be lost)."""
    engines = FakeWorkers()
    engines.execute(
        Command(cmd_id="a", step_id=0, action=Action.START, worker_id="e-trainer-0", deadline_s=1.0)
    )
    slot = TrainerSlot(FakeTrainer())
    c = LocalControl(LocalServer(["trainer"], engines, TrainerWorkers(slot, ("t-trainer",))))
    assert [e.workers for e in c.events()] == [("t-trainer", "e-trainer-0")]
    c.close()


def test_a_step_past_its_deadline_is_a_timeout_and_nothing_after_it_runs() -> None:
    engines = FakeWorkers(slow_s={"e0": 1.5})
    c = control(engines)
    t0 = time.monotonic()
    out = c.execute(
        plan(
            step(0, Action.DRAIN, "e0", duration_s=0.01),
            step(1, Action.STOP, "e0", deps=(0,)),
        )
    )
    assert time.monotonic() - t0 < 1.4  # the plan did not wait for the late step
    assert not out.ok and out.carried_out == frozenset()
    assert "no result" in out.error
    c.close()


def test_the_trainer_slot_holds_updates_while_offloaded() -> None:
    status = TrainerSource(lambda: 0.0, train_time_s=1.0)
    slot = TrainerSlot(FakeTrainer(), status)
    slot.offload()
    assert slot.offloaded
    ran = threading.Event()

    async def update() -> None:
        async with slot.update():
            assert status().phase is TrainerPhase.TRAINING
            ran.set()

    async def main() -> None:
        task = asyncio.ensure_future(update())
        await asyncio.sleep(0.2)
        assert not ran.is_set() and status().needs_gpus  # the batch is ready, the slot lent
        await asyncio.to_thread(slot.onload)
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert ran.is_set() and (slot.offloads, slot.onloads) == (1, 1)
    assert status().phase is TrainerPhase.WAITING and not status().needs_gpus


def test_a_trainer_lost_while_lent_does_not_hold_the_update_forever() -> None:
    """The onload of a trainer whose process died raises ``TrainerLost`` (the plan step
    fails), and the update waiting for the slot goes on, to meet the loss itself (the run
    then starts a new trainer)."""

    class LostTrainer(FakeTrainer):
        def onload(self) -> None:
            raise TrainerLost("trainer http://127.0.0.1:1/onload: no answer")

    slot = TrainerSlot(LostTrainer())
    slot.offload()
    ran = threading.Event()

    async def update() -> None:
        async with slot.update():
            ran.set()

    async def main() -> None:
        task = asyncio.ensure_future(update())
        await asyncio.sleep(0.2)
        assert not ran.is_set()
        with pytest.raises(TrainerLost):
            await asyncio.to_thread(slot.onload)
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert ran.is_set() and not slot.offloaded


def test_the_trainer_source_reports_training_and_waiting() -> None:
    now = [100.0]
    src = TrainerSource(lambda: now[0], train_time_s=7.0)
    assert src().phase is TrainerPhase.WAITING and not src().needs_gpus
    src.training()
    assert src().phase is TrainerPhase.TRAINING and src().step_ends_at_s == 107.0
    src.waiting(batch_ready=True)
    assert src().phase is TrainerPhase.WAITING and src().needs_gpus


def test_the_trainer_source_predicts_an_update_from_the_last_measured_ones() -> None:
    now = [0.0]
    src = TrainerSource(lambda: now[0], train_time_s=7.0, window=2)
    for start, took in ((10.0, 3.0), (20.0, 5.0), (30.0, 1.0)):
        now[0] = start
        src.training()
        now[0] = start + took
        src.waiting()
    now[0] = 100.0
    src.training()  # the mean of the last two: (5 + 1) / 2
    assert src().step_ends_at_s == pytest.approx(103.0)


def test_slots_get_their_own_cores_only_where_there_are_enough() -> None:
    assert slot_cores(["a", "b"], cpus=[0, 1]) == {}
    pinned = slot_cores(["a", "b"], cpus=list(range(6)))
    assert pinned in ({"a": [0, 1, 2], "b": [3, 4, 5]}, {})  # {} without taskset


def test_a_hand_made_plan_over_real_engines_moves_the_router(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from pearl.router.plan_steps import PlanSteps
    from pearl.router.router import Router
    from pearl.trainer.reference import ReferenceTrainer

    trainer = ReferenceTrainer(tiny_model_dir)
    published: list[tuple[Path, int]] = []
    engines = LocalEngines(
        {"*": engine_template(RunConfig(), tiny_model_dir)},
        {"localhost/0": 0, "localhost/1": 1},
        log_dir=str(tmp_path),
        weights=lambda: published[-1] if published else None,
    )
    slot = TrainerSlot(trainer)

    async def main() -> None:
        router = Router()
        listener = RouterListener(PlanSteps(router), asyncio.get_running_loop())
        server = LocalServer([NODE], engines, TrainerWorkers(slot))
        c = LocalControl(server, listener, min_deadline_s=60.0)
        try:
            start = plan(
                step(0, Action.START, "e0", Role.COLOCATED, gpus=("localhost/0",)),
                step(1, Action.START, "e1", Role.COLOCATED, gpus=("localhost/1",)),
            )
            out = await asyncio.to_thread(c.execute, start)
            assert out.ok, out.error
            assert {i.worker_id: i.role for i in router.table} == {
                "e0": Role.COLOCATED,
                "e1": Role.COLOCATED,
            }
            assert all(i.accepting for i in router.table)
            published.append((trainer.export_weights(tmp_path / "weights"), trainer.version))
            change = plan(
                step(0, Action.DRAIN, "e1", gpus=("localhost/1",)),
                step(1, Action.SWITCH, "e1", Role.DECODE, deps=(0,), gpus=("localhost/1",)),
                step(2, Action.SYNC_WEIGHTS, "e0"),
                step(3, Action.OFFLOAD, "t0", Role.IDLE, gpus=("trainer/0",)),
                step(4, Action.ONLOAD, "t0", Role.TRAIN, deps=(3,), gpus=("trainer/0",)),
            )
            out = await asyncio.to_thread(c.execute, change)
            assert out.ok, out.error
            assert router.table.get("e1").role is Role.DECODE
            assert (slot.offloads, slot.onloads) == (1, 1) and not trainer.offloaded
            out = await asyncio.to_thread(
                c.execute,
                plan(
                    step(0, Action.DRAIN, "e0"),
                    step(1, Action.STOP, "e0", deps=(0,)),
                ),
            )
            assert out.ok, out.error
            await listener.steps.settle()
            assert [i.worker_id for i in router.table] == ["e1"]
            assert engines.worker_ids() == ("e1",)
        finally:
            await asyncio.to_thread(c.close, 10.0)
            await router.aclose()

    asyncio.run(main())
    assert engines.worker_ids() == ()


@pytest.mark.fault
def test_a_forced_return_moves_the_turns_in_flight_on_the_lent_slot(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The trainer's slot is lent (the trainer offloaded, an engine started there) and
    serves long turns beside the base rollout's engine; the batch is ready, so the slot
    is taken back while turns are in flight on it, by the steps the planner gives a
    forced return (the trainer waits: migrate, then sleep, onload; the plan is written
    here, the policy's choice of it is ``test_coordinator_local.py``'s). Each of those turns goes on
    elsewhere with its tokens so far and ends whole; none is lost; the trainer has its
    devices back within the policy's ``max_return_delay_s``."""
    pytest.importorskip("torch")
    from pearl.core.config import BorrowingConfig
    from pearl.router.plan_steps import PlanSteps
    from pearl.router.router import Router, Sampling, Turn
    from pearl.trainer.reference import ReferenceTrainer

    def at(sid: int, action: Action, worker: str, node: str, **kw: object) -> PlanStep:
        role, deps = kw.get("role"), kw.get("deps", ())
        gpus = kw.get("gpus", ())
        return PlanStep(sid, action, worker, node, gpus, role, deps, 1.0, 0.0, "test")  # type: ignore[arg-type]

    trainer = ReferenceTrainer(tiny_model_dir)
    engines = LocalEngines(
        {"*": engine_template(RunConfig(), tiny_model_dir)},
        {"trainer/0": 0, "rollout/0": 1},
        log_dir=str(tmp_path),
    )
    slot = TrainerSlot(trainer)
    max_return_delay_s = BorrowingConfig().max_return_delay_s
    sampling = Sampling(max_tokens=1000, ignore_eos=True, seed=0)  # turns of seconds

    async def main() -> tuple[list[list[str]], float]:
        router = Router()
        listener = RouterListener(PlanSteps(router), asyncio.get_running_loop())
        server = LocalServer(["trainer", "rollout"], engines, TrainerWorkers(slot))
        c = LocalControl(server, listener, min_deadline_s=60.0)
        try:
            slot0, base0, c_, idle = ("trainer/0",), ("rollout/0",), Role.COLOCATED, Role.IDLE
            lend = plan(
                at(0, Action.START, "e-rollout-0", "rollout", role=c_, gpus=base0),
                at(1, Action.OFFLOAD, "t0", "trainer", role=Role.IDLE, gpus=slot0),
                at(2, Action.START, "e-trainer-0", "trainer", role=c_, deps=(1,), gpus=slot0),
            )
            out = await asyncio.to_thread(c.execute, lend)
            assert out.ok, out.error
            turns = [
                asyncio.create_task(router.generate(Turn(f"t{i}", (1, 2, 3, 4 + i), sampling)))
                for i in range(8)
            ]
            lent = router.table.get("e-trainer-0")
            end = time.monotonic() + 30
            while not lent.in_flight:  # turns on the lent slot
                assert time.monotonic() < end, "no turn reached the lent slot"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # mid-turn: some tokens generated there
            back = plan(
                at(0, Action.MIGRATE, "e-trainer-0", "trainer", gpus=slot0),
                at(1, Action.SLEEP, "e-trainer-0", "trainer", role=idle, deps=(0,), gpus=slot0),
                at(2, Action.ONLOAD, "t0", "trainer", role=Role.TRAIN, deps=(1,), gpus=slot0),
            )
            assert lent.in_flight, "the turns on the lent slot ended before its return"
            t0 = time.monotonic()
            out = await asyncio.to_thread(c.execute, back)
            waited_s = time.monotonic() - t0
            assert out.ok, out.error
            outputs = await asyncio.gather(*turns)
            assert all(len(o.token_ids) == sampling.max_tokens for o in outputs)
            return [o.served_by for o in outputs], waited_s
        finally:
            await asyncio.to_thread(c.close, 10.0)
            await router.aclose()

    served_by, waited_s = asyncio.run(main())
    moved = [s for s in served_by if "e-trainer-0" in s and s[-1] != "e-trainer-0"]
    assert moved, served_by  # at least one turn was on the slot at the return and went on
    assert not trainer.offloaded and (slot.offloads, slot.onloads) == (1, 1)
    assert waited_s <= max_return_delay_s, waited_s
    print(f"{len(moved)} of 8 turns moved off the lent slot; the trainer waited {waited_s:.2f} s")
