"""The rollout manager over real reference engines and the arithmetic environment: batches
of whole groups handed to a trainer in-process and across processes (the spool), the
past-bound rule at updates, the predictor's snapshot and the run log written, and a
manager killed mid-rollout that resumes from its journal with nothing lost silently."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from engine_procs import EngineProc, running_engines
from manager_setup import CONFIG, open_manager

from pearl.agents.batches import RolloutBatch, trajectory_doc
from pearl.agents.journal import JournalError, read_journal
from pearl.agents.manager import JOURNAL, RUN_LOG, SPOOL, WORKLOAD, RolloutManager
from pearl.core.roles import Role
from pearl.core.workload import WorkloadSnapshot
from pearl.io.documents import parse, read_document
from pearl.rollout.ledger import TrajState
from pearl.runlog.jsonl import read_records

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[EngineProc]]:
    with running_engines(
        tiny_model_dir, tmp_path_factory.mktemp("manager-engines"), ("m0", "m1", "m2")
    ) as procs:
        yield procs


def _check_batch(batch: RolloutBatch, seen: set[str]) -> None:
    rules = CONFIG.rules
    assert len(batch.trajectories) == rules.batch_trajectories
    for group in batch.groups.values():
        assert len(group) == rules.group_size  # whole groups
        first_prompts = {tuple(t.token_ids[: t.turns[0].prompt_tokens]) for t in group if t.turns}
        assert len(first_prompts) <= 1, "a group's members share one task"
    for t in batch.trajectories:
        assert t.traj_id not in seen, "a trajectory in two batches"
        seen.add(t.traj_id)
        assert t.end_reason
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
    assert batch.max_staleness_versions <= rules.max_staleness_versions


async def _run_batches(manager: RolloutManager, n: int, seen: set[str]) -> list[RolloutBatch]:
    out = []
    for _ in range(n):
        batch = await asyncio.wait_for(manager.next_batch(), 120)
        _check_batch(batch, seen)
        out.append(batch)
        await manager.updated(batch.policy_version + 1)
    return out


def test_batches_of_whole_groups_snapshot_and_run_log(
    engines: list[EngineProc],
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    urls = [e.url for e in engines[:2]]

    async def run() -> tuple[list[RolloutBatch], WorkloadSnapshot]:
        manager = await open_manager(tiny_model_dir, tmp_path, urls)
        manager.start()
        try:
            snap = WorkloadSnapshot()
            for _ in range(200):  # the snapshot written while the first groups run
                await asyncio.sleep(0.05)
                if (tmp_path / WORKLOAD).exists():
                    snap = parse(WorkloadSnapshot, read_document(tmp_path / WORKLOAD), tmp_path)
                    if len(snap.trajectories) == CONFIG.rules.max_in_flight:
                        break
            batches = await _run_batches(manager, 3, set())
            manager.ledger.check()
            return batches, snap
        finally:
            await manager.close()
            await manager.router.aclose()

    batches, snap = asyncio.run(run())
    assert [b.batch_id for b in batches] == [0, 1, 2]
    assert [b.policy_version for b in batches] == [0, 1, 2]
    assert snap.next_batch is not None and snap.next_batch.group_size == 2
    assert len(snap.trajectories) == 8, "the running trajectories in the predictor's snapshot"
    assert snap.next_batch.groups_needed == 2  # nothing had finished yet
    assert len({t.group_id for t in snap.trajectories}) == 4  # in their groups
    # the spool holds every batch handed over
    assert sorted(p.name for p in (tmp_path / SPOOL).glob("batch-*.json")) == [
        "batch-000000.json",
        "batch-000001.json",
        "batch-000002.json",
    ]
    records = list(read_records(tmp_path / RUN_LOG))
    kinds = [r.type for r in records]
    assert kinds[0] == "run_started"
    assert kinds.count("batch_consumed") == 3
    turns = [r for r in records if r.type == "turn_ended"]
    finished = {r.traj_id: r for r in records if r.type == "trajectory_finished"}
    for b in batches:
        for t in b.trajectories:
            assert finished[t.traj_id].num_turns == len(t.turns)
            assert finished[t.traj_id].output_tokens == sum(t.loss_mask)
            # (a restart's earlier attempt logged its turns too: the last ones are these)
            logged = [r for r in turns if r.traj_id == t.traj_id]
            logged = logged[len(logged) - len(t.turns) :]
            assert [r.output_tokens for r in logged] == [x.output_tokens for x in t.turns]
            assert [r.turn for r in logged] == list(range(len(t.turns)))
    # pearl analyze reads the real run's turns, tokens and tool latencies
    rollout = _analyzed(tmp_path, capsys)
    assert rollout["turns"] == len(turns) > 0
    assert rollout["output_tokens"] == sum(r.output_tokens for r in turns)
    assert rollout["trajectories_finished"] == len(finished)
    assert rollout["tool_steps"] == sum(r.env_s is not None for r in turns)
    assert rollout["output_tokens_per_s"] > 0 and rollout["tool_s"]["p50"] is not None
    assert rollout["remote_prefill_turns"] == 0  # colocated


def _analyzed(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """``pearl analyze --json`` over the manager's run log: its rollout section."""
    from pearl.cli.main import main

    capsys.readouterr()
    out = run_dir / "report"
    assert main(["analyze", str(run_dir / RUN_LOG), "--out", str(out), "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["read"]["invalid"] == run["read"]["malformed"] == 0
    return dict(run["rollout_turns"])


def test_a_disaggregated_rollout_through_a_pd_ratio_change(
    engines: list[EngineProc],
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Multi-turn trajectories prefilled on one instance and decoded on another; after the
    first batch a plan turns 1 prefill : 1 decode into 1 : 2 (a start) and then 2 : 1 (a
    drain and a switch of the first decode instance to prefill), under the manager's load;
    every trajectory finishes as its environment ends it."""
    from pearl.core.plan import Action
    from pearl.core.roles import Role
    from pearl.router.plan_steps import PlanSteps

    switched_t: list[float] = []

    async def run() -> list[RolloutBatch]:
        manager = await open_manager(
            tiny_model_dir,
            tmp_path,
            [engines[0].url, engines[1].url],
            roles=[Role.PREFILL, Role.DECODE],
        )
        steps = PlanSteps(manager.router)
        manager.start()
        seen: set[str] = set()
        try:
            batches = await _run_batches(manager, 1, seen)
            steps.start(Action.START, "e2")
            steps.end(Action.START, "e2", Role.DECODE, engines[2].url)  # 1 : 2
            batches += await _run_batches(manager, 1, seen)
            steps.start(Action.DRAIN, "e1")
            await asyncio.wait_for(manager.router.table.get("e1").idle.wait(), 60)
            steps.end(Action.DRAIN, "e1")
            steps.start(Action.SWITCH, "e1")
            steps.end(Action.SWITCH, "e1", Role.PREFILL)  # 2 : 1
            switched_t.append(manager.now_s())
            batches += await _run_batches(manager, 1, seen)
            manager.ledger.check()
            return batches
        finally:
            await manager.close()
            await manager.router.aclose()

    trajs = [t for b in asyncio.run(run()) for t in b.trajectories]
    assert all(t.end_reason in ("answered", "max_turns") for t in trajs), [
        t.end_reason for t in trajs
    ]
    turns = [turn for t in trajs for turn in t.turns]
    assert all(turn.prefilled_by for turn in turns), "a turn ran colocated"
    assert _analyzed(tmp_path, capsys)["remote_prefill_share"] == 1.0
    turns_logged = [r for r in read_records(tmp_path / RUN_LOG) if r.type == "turn_ended"]
    assert {r.served_by[-1] for r in turns_logged} >= {"e1", "e2"}  # both decoded at 1 : 2
    after = [r for r in turns_logged if r.started_t > switched_t[0]]
    assert after, "no turn after the switch"
    # at 2 : 1 the one decode instance is e2 (e1 prefills now, when the rule picks it)
    assert {r.served_by[-1] for r in after} == {"e2"}
    assert {r.prefilled_by[0] for r in after} <= {"e0", "e1"}


def test_a_trainer_in_another_process_reads_the_spool(
    engines: list[EngineProc], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The spool's protocol: the trainer's ``want`` brings the batch, its ``updated`` the
    new version; the trainer here is a subprocess."""
    trainer = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from pearl.agents.batches import SpoolClient\n"
        "async def main():\n"
        "    c = SpoolClient(Path(sys.argv[1]))\n"
        "    for i in range(2):\n"
        "        b = await c.batch(i, timeout_s=120)\n"
        "        print(b.batch_id, b.policy_version, len(b.trajectories), flush=True)\n"
        "        c.updated(b.policy_version + 1)\n"
        "asyncio.run(main())\n"
    )

    async def run() -> str:
        manager = await open_manager(tiny_model_dir, tmp_path, [e.url for e in engines[:2]])
        manager.start()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", trainer, str(tmp_path / SPOOL), stdout=subprocess.PIPE
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 180)
            for _ in range(100):  # the manager applies the last update
                if manager.ledger.version == 2:
                    break
                await asyncio.sleep(0.05)
            assert manager.ledger.version == 2
            return out.decode()
        finally:
            await manager.close()
            await manager.router.aclose()

    assert asyncio.run(run()).split() == ["0", "0", "4", "1", "1", "4"]


def test_a_killed_manager_resumes_from_its_journal(
    engines: list[EngineProc], tiny_model_dir: Path, tmp_path: Path
) -> None:
    urls = ",".join(e.url for e in engines[:2])
    err_path = tmp_path / "manager.err"
    with err_path.open("wb") as err:
        script = str(HERE / "manager_proc.py")
        proc = subprocess.Popen(
            [sys.executable, script, str(tiny_model_dir), str(tmp_path), urls],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    journal = tmp_path / JOURNAL
    deadline = time.monotonic() + 180
    try:
        while True:  # until it has handed over a batch and has turns in flight
            assert proc.poll() is None, err_path.read_text(encoding="utf-8")
            assert time.monotonic() < deadline, "no batch before the deadline"
            events = list(read_journal(journal)) if journal.exists() else []
            kinds = [e["e"] for e in events]
            if "batch" in kinds and kinds[-1] == "turn":
                break
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = list(read_journal(journal))
    last_doc = {e["traj_id"]: e["trajectory"] for e in before if e["e"] == "finish"}
    batched_before = {t for e in before if e["e"] == "batch" for t in e["traj_ids"]}

    async def resume() -> tuple[list[RolloutBatch], set[str], set[str]]:
        manager = await open_manager(tiny_model_dir, tmp_path, urls.split(","))
        led = manager.ledger
        waiting = {t for t, r in led.trajectories.items() if r.state is TrajState.FINISHED}
        # what had finished and was not in a batch comes back whole (an update may have
        # started some finished ones again: those are running, and lost)
        assert waiting <= set(last_doc) - batched_before
        assert set(manager.finished) == waiting
        for traj_id in waiting:
            assert trajectory_doc(manager.finished[traj_id]) == last_doc[traj_id]
        lost = set(manager.live)
        manager.start()
        try:
            batches = await _run_batches(manager, 2, set(batched_before))
            led.check()
            return batches, waiting, lost
        finally:
            await manager.close()
            await manager.router.aclose()

    batches, _, lost = asyncio.run(resume())
    assert lost, "the kill caught trajectories running"
    first_id = 1 + max(e["batch_id"] for e in before if e["e"] == "batch")
    assert [b.batch_id for b in batches] == [first_id, first_id + 1]
    records = list(read_records(tmp_path / RUN_LOG))
    logged_lost = {r.traj_id for r in records if r.type == "trajectory_lost"}
    assert logged_lost == lost  # none lost silently
    assert all(r.reason == "manager_restart" for r in records if r.type == "trajectory_lost")


def test_a_corrupt_journal_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL
    path.parent.mkdir(parents=True)
    good = json.dumps({"e": "start", "t": 0.0})
    path.write_text(f"{good}\nnot json\n{good}\n{good[:10]}", encoding="utf-8")
    with pytest.raises(JournalError, match=r"journal.jsonl:2: "):
        list(read_journal(path))
    for torn in (good[:10], good):  # a last line without its newline did not finish
        path.write_text(f"{good}\n{torn}", encoding="utf-8")
        assert len(list(read_journal(path))) == 1
        assert path.read_text(encoding="utf-8") == f"{good}\n{torn}"  # a reader writes nothing
        assert len(list(read_journal(path, repair=True))) == 1
        assert path.read_text(encoding="utf-8") == f"{good}\n"  # the resuming manager cuts it


class _Stubborn:
    """The arithmetic environment; every third episode's steps take 2 s (the others'
    0.05 s), so that those fall behind and an update restarts them mid-step, and a
    cancellation that arrives meanwhile is swallowed (as Python 3.11's ``asyncio.wait_for``
    can when it meets a result): the episode goes on after the update that cancelled it."""

    swallowed = 0
    made = 0

    def __init__(self) -> None:
        from pearl.envs import registry

        self.inner = registry.make({"name": "arithmetic", "max_turns": 3}, "test.yaml")
        self.tools, self.system_prompt = self.inner.tools, self.inner.system_prompt
        _Stubborn.made += 1
        self.step_s = 2.0 if _Stubborn.made % 3 == 0 else 0.05

    async def reset(self, seed: int | None = None, options: dict[str, Any] | None = None):  # type: ignore[no-untyped-def]
        return await self.inner.reset(seed, options)

    async def step(self, action: str):  # type: ignore[no-untyped-def]
        try:
            await asyncio.sleep(self.step_s)
        except asyncio.CancelledError:
            _Stubborn.swallowed += 1
        return await self.inner.step(action)

    async def close(self) -> None:
        await self.inner.close()


def test_an_episode_that_outlives_its_cancellation_finishes_nothing(
    engines: list[EngineProc], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An update restarts trajectories past the bound; an episode whose cancellation was
    swallowed goes on, and must not finish (or count tokens for) the trajectory restarted
    in its place: every batch stays whole and the ledger's books balance."""
    from pearl.engines.reference.tokenizer import load
    from pearl.router.router import Router

    async def run() -> tuple[int, int]:
        router = Router()
        for i, e in enumerate(engines[:2]):
            router.table.serve(f"e{i}", e.url, Role.COLOCATED)
        manager = await RolloutManager.open(
            router, _Stubborn, load(tiny_model_dir), CONFIG, tmp_path
        )
        restarted = 0
        try:
            manager.start()
            seen: set[str] = set()
            for _ in range(6):
                batch = await asyncio.wait_for(manager.next_batch(), 120)
                _check_batch(batch, seen)
                outcome = await manager.updated(batch.policy_version + 1)
                restarted += len(outcome.restarted) - outcome.taken_back  # running ones
                manager.ledger.check()
            assert not [t for t in manager.finished.values() if t.end_reason == "agent_error"]
        finally:
            await manager.close()
            await router.aclose()
        return restarted, _Stubborn.swallowed

    restarted, swallowed = asyncio.run(run())
    assert restarted > 0 and swallowed > 0, (restarted, swallowed)  # the case happened
