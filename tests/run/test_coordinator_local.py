"""The coordinator's real ``decide()`` carried out by ``LocalControl`` on one machine.

A base job of one trainer slot and two rollout slots, a large rollout batch waiting, the
trainer's status from a ``TrainerSource``, workers that record what they are told (the
real reference engines are ``test_local_control.py``'s). The policy, not the test,
decides: the first decision starts the engines and lends the trainer's slot (offload, an
engine started on it) while the trainer waits for its batch; once the batch is ready the
slot comes back at once (a forced return: the engine's turns migrated, the engine put to
sleep, the trainer onloaded); waiting
again, it is lent again (offload, the sleeping engine woken). The run log
(``events.jsonl``) holds the decisions, plan steps and the borrow windows."""

from __future__ import annotations

import json
from pathlib import Path

from test_local_control import FakeTrainer, FakeWorkers

from pearl.coordinator.config import CoordinatorConfig
from pearl.coordinator.loop import Coordinator, workload_file
from pearl.core.plan import Action
from pearl.core.roles import Role
from pearl.io.documents import load_profile
from pearl.run.control import (
    LocalControl,
    LocalServer,
    TrainerSlot,
    TrainerSource,
    TrainerWorkers,
)
from pearl.run.coordinated import NoElastic


def config(run: Path) -> CoordinatorConfig:
    return CoordinatorConfig.model_validate(
        {
            "schema_version": 1,
            "run_id": "local",
            "run_dir": str(run),
            "profile": "qwen3-8b",
            "backend": "local",
            "gpus_per_node": {"h100": 1},
            "decision_interval_s": 0.1,
            "base": {
                "trainer": [{"name": "n0", "gpu_type": "h100", "num_gpus": 1}],
                "rollout": [{"name": "n1", "gpu_type": "h100", "num_gpus": 2}],
            },
            "policy": {"elastic": {"rule": "never"}},
        }
    )


def test_the_policy_lends_the_trainers_slot_and_takes_it_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    trajs = [
        {"traj_id": f"q{i}", "phase": "queued", "context_tokens": 4000, "remaining_turns": 8}
        for i in range(2048)
    ]
    (run / "workload.json").write_text(json.dumps({"trajectories": trajs}), encoding="utf-8")
    now = [0.0]

    def clock() -> float:
        return now[0]

    engines, trainer = FakeWorkers(), FakeTrainer()
    slot = TrainerSlot(trainer)
    status = TrainerSource(clock, train_time_s=60.0)
    control = LocalControl(
        LocalServer(["n0", "n1", "localhost"], engines, TrainerWorkers(slot, ("t-n0",))),
        min_deadline_s=1.0,
    )
    co = Coordinator.open(
        config(run),
        load_profile("qwen3-8b"),
        run,
        NoElastic(),
        clock,
        workload_file(run / "workload.json"),
        control,
        status,
    )
    try:
        lend = co.tick()  # waiting for its first batch: lending pays
        steps = {(s.action, s.node) for s in lend.plan.steps}
        assert (Action.OFFLOAD, "n0") in steps and (Action.START, "n0") in steps
        assert slot.offloaded and co.state.borrow is not None

        status.waiting(batch_ready=True)
        now[0] += 10.0
        back = co.tick()  # the batch is ready: the slot comes back before the update,
        assert [s.action for s in back.plan.steps if s.node == "n0"] == [
            Action.MIGRATE,  # its turns moved at once: the trainer waits (a forced return)
            Action.SLEEP,
            Action.ONLOAD,
        ]
        assert not slot.offloaded
        trainers = [w for w in co.state.workers if w.node == "n0" and w.role is Role.TRAIN]
        assert len(trainers) == 1

        status.training()
        now[0] += 10.0
        assert co.tick().plan.empty  # training: nothing to lend

        status.waiting()
        now[0] += 60.0
        again = co.tick()  # the update is done: lent again, the sleeping engine woken
        assert {s.action for s in again.plan.steps} == {Action.OFFLOAD, Action.WAKE}
        assert trainer.calls == ["offload", "onload", "offload"]
        assert ("sleep", "e-n0-0") in engines.done and ("wake", "e-n0-0") in engines.done
    finally:
        co.close("done")
    records = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    borrows = [r["kind"] for r in records if r["type"] == "borrow"]
    assert borrows[:3] == ["lend", "force_return", "returned"] and borrows.count("lend") == 2
    steps = [r["action"] for r in records if r["type"] == "plan_step"]
    assert steps.count("offload") == 2
    assert {"start", "migrate", "sleep", "onload", "wake"} <= set(steps)


def test_a_baseline_is_pearl_s_policy_with_its_rules_fixed() -> None:
    from pearl.run.config import CoordinatorSection

    pearl = CoordinatorSection().policy_config()
    assert pearl.borrowing.rule == "predictive" and pearl.borrowing.min_gain_s == 0.2
    fixed = CoordinatorSection(policy_name="roll-fixed").policy_config()
    assert fixed.borrowing.rule == "never" and fixed.switching.rule == "never"
    assert fixed.selection.modes == "colocated" and fixed.borrowing.min_gain_s == 0.2
