"""Plan steps on the router while traffic flows (``pearl.router.plan_steps``), over real
reference engines (processes, HTTP): a started instance takes turns only once its start
has ended, a drained one takes no new turn while its turn in flight finishes there, a
role switch of a ``kv_both`` engine changes where turns go, a migration under load
continues every turn elsewhere with the tokens of an uninterrupted greedy run, sleep and
stop take an instance out; then the same over HTTP, the coordinator's listener
(``pearl.router.steps_client.RouterSteps``) posting to a running front, and the route's
400s. The table's bookkeeping without traffic (unknown workers, failed steps, a drain
undone) needs no engine."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")

from engine_procs import EngineProc, running_engines, start_engine, wait_healthy
from router_turns import Turns, check_greedy, direct, router_over, serving_front, trajectory

from pearl.control.coordinator_side import CommandStatus
from pearl.control.execute import PlanStepResult
from pearl.core.execution import StepEffect
from pearl.core.plan import Action, PlanStep
from pearl.core.roles import Phase, Role
from pearl.engines.client import EngineClient
from pearl.router.plan_steps import PlanSteps
from pearl.router.router import Router, Sampling, Turn
from pearl.router.steps_client import RouterSteps

A, R = Action, Role
SHORT = Sampling(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = Sampling(max_tokens=400, temperature=0.0, ignore_eos=True)  # about 0.6 s here
LONGER = Sampling(max_tokens=1000, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[EngineProc]]:
    with running_engines(
        tiny_model_dir, tmp_path_factory.mktemp("plan-step-engines"), ("e0", "e1", "e2")
    ) as procs:
        yield procs


async def _in_flight_on(r: Router, worker_id: str, n: int = 1, timeout_s: float = 20) -> None:
    end = time.monotonic() + timeout_s
    while r.table.get(worker_id).load < n:
        assert time.monotonic() < end, f"no {n} requests in flight on {worker_id}"
        await asyncio.sleep(0.005)


def _where(trajs: list[Turns]) -> list[list[str]]:
    return [by for turns in trajs for _, _, by in turns]


# -- the table, with real engines -------------------------------------------------------


def test_a_started_instance_takes_turns_once_its_start_has_ended(
    engines: list[EngineProc],
) -> None:
    e0, e1, _ = engines

    async def run() -> tuple[list[Turns], list[Turns], list[str]]:
        r = router_over([e0], [R.COLOCATED])
        steps = PlanSteps(r)
        try:
            assert steps.start(A.START, "e1").effect is None  # starting: not routable yet
            before = await asyncio.gather(
                *(trajectory(r, f"b{i}", [5 + i, 6, 7], 2, SHORT) for i in range(3))
            )
            applied = steps.end(A.START, "e1", R.COLOCATED, e1.url)
            assert applied.effect is StepEffect.JOIN
            after = await asyncio.gather(
                *(trajectory(r, f"a{i}", [5 + i, 6, 7], 2, SHORT) for i in range(4))
            )
            # a sleep takes it out (once its requests are back), a wake brings it back
            steps.start(A.SLEEP, "e1")
            await steps.settle()
            assert "e1" not in r.table
            steps.end(A.WAKE, "e1", R.COLOCATED, e1.url)
            return before, after, [i.worker_id for i in r.table if i.accepting]
        finally:
            await r.aclose()

    before, after, accepting = asyncio.run(run())
    assert {w for by in _where(before) for w in by} == {"e0"}
    assert "e1" in {w for by in _where(after) for w in by}
    assert sorted(accepting) == ["e0", "e1"]
    for turns in before + after:
        check_greedy(engines[2].url, turns)


def test_a_drained_instance_finishes_its_turn_and_takes_no_new_one(
    engines: list[EngineProc],
) -> None:
    e0, e1, e2 = engines
    prompt = [2, 7, 1, 8, 2, 8]

    async def run() -> tuple[Any, list[Turns], Phase]:
        r = router_over([e0], [R.COLOCATED])
        steps = PlanSteps(r)
        try:
            long = asyncio.ensure_future(r.generate(Turn("long", tuple(prompt), LONGER, "l0")))
            await _in_flight_on(r, "e0")
            steps.end(A.START, "e1", R.COLOCATED, e1.url)
            assert steps.start(A.DRAIN, "e0").effect is StepEffect.STOP_ADMITTING
            others = await asyncio.gather(
                *(trajectory(r, f"d{i}", [30 + i, 4], 2, SHORT) for i in range(3))
            )
            assert not long.done(), "the long turn ended before the drain was tested"
            out = await asyncio.wait_for(long, 60)
            return out, others, r.table.get("e0").phase
        finally:
            await r.aclose()

    out, others, phase = asyncio.run(run())
    assert out.served_by == ["e0"] and out.continuations == 0  # finished where it was
    assert out.token_ids == asyncio.run(direct(e2.url, prompt, LONGER.max_tokens))
    assert {w for by in _where(others) for w in by} == {"e1"}  # no new turn to e0
    assert phase is Phase.DRAINING


def test_a_role_switch_of_a_kv_both_engine_changes_where_turns_go(
    engines: list[EngineProc],
) -> None:
    """e0 prefill, e1 decode, e2 prefill; the plan drains e0 and switches it to decode:
    after the switch's end e0 decodes and never prefills, during it no turn goes there."""

    async def run() -> tuple[list[Turns], list[Turns], set[str]]:
        r = router_over(engines, [R.PREFILL, R.DECODE, R.PREFILL])
        steps = PlanSteps(r)
        try:
            before = await asyncio.gather(
                *(trajectory(r, f"p{i}", [40 + i, 5, 6, 7], 2, SHORT) for i in range(3))
            )
            steps.start(A.DRAIN, "e0")
            await r.table.get("e0").idle.wait()
            steps.end(A.DRAIN, "e0")
            assert steps.start(A.SWITCH, "e0").effect is StepEffect.LEAVE
            switching = set(r.table.candidates().entry_ids) | {
                i.worker_id for i in r.table if i.accepting
            }
            assert steps.end(A.SWITCH, "e0", R.DECODE).effect is StepEffect.JOIN
            after = await asyncio.gather(
                *(trajectory(r, f"q{i}", [50 + i, 5, 6, 7], 3, SHORT) for i in range(4))
            )
            return before, after, switching
        finally:
            await r.aclose()

    before, after, switching = asyncio.run(run())
    assert "e0" not in switching  # out of traffic while it switches
    assert any(by[0] == "e0" for by in _where(before)), "e0 prefilled no turn before"
    where = _where(after)
    assert all(by[0] == "e2" for by in where)  # the one prefill instance left
    assert "e0" in {by[-1] for by in where}, "no turn decoded on e0 after its switch"
    for turns in before + after:
        check_greedy(engines[1].url, turns)


def test_a_migration_under_load_continues_every_turn_elsewhere_unchanged(
    engines: list[EngineProc],
) -> None:
    """Four trajectories of long turns on e0; e1 starts, e0 migrates (its requests
    aborted, each turn continued on e1) and stops: no turn is lost or changed, and e0
    leaves the table once its requests are back."""

    async def run() -> tuple[list[Turns], int, list[str]]:
        r = router_over(engines[:1], [R.COLOCATED])
        steps = PlanSteps(r)
        try:
            load = [
                asyncio.ensure_future(trajectory(r, f"m{i}", [60 + i, 3, 4], 2, LONG))
                for i in range(4)
            ]
            await _in_flight_on(r, "e0", 4)
            await asyncio.sleep(0.1)  # some tokens in, most to come
            steps.end(A.START, "e1", R.COLOCATED, engines[1].url)
            applied = steps.start(A.MIGRATE, "e0")
            assert applied.effect is StepEffect.LEAVE, applied
            await steps.settle()
            in_flight_after = r.table.get("e0").load
            steps.start(A.STOP, "e0")
            await steps.settle()
            trajs = await asyncio.wait_for(asyncio.gather(*load), 120)
            return trajs, in_flight_after, [i.worker_id for i in r.table]
        finally:
            await r.aclose()

    trajs, in_flight_after, left = asyncio.run(run())
    assert in_flight_after == 0 and left == ["e1"]
    where = _where(trajs)
    assert sum(by == ["e0", "e1"] for by in where) == 4  # each first turn moved once
    assert all(by == ["e1"] for turns in trajs for _, _, by in turns[1:])
    for turns in trajs:
        assert all(len(tokens) == LONG.max_tokens for _, tokens, _ in turns)
        check_greedy(engines[2].url, turns)


def test_a_sleep_takes_back_more_requests_than_one_connection_pool_holds(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """130 long turns on an engine that runs 2 at a time (the rest wait there), more than
    httpx's default pool of 100 connections: the sleep's aborts reach the engine at once,
    not queued behind generations the sleeping engine will never finish (a ``pearl run``
    hung so in CI, 177 requests in flight on the trainer's engine)."""
    (e,) = procs = [start_engine(tiny_model_dir, tmp_path, "s0", "--max-num-seqs", "2")]
    n = 130

    async def run() -> tuple[float, list[str]]:
        r = router_over(procs, [R.COLOCATED])
        steps = PlanSteps(r, leave_timeout_s=10)
        load = [
            asyncio.ensure_future(r.generate(Turn(f"p{i}", (70 + i % 50, 3, 4), LONGER)))
            for i in range(n)
        ]
        try:
            await _in_flight_on(r, "s0", n)
            assert steps.start(A.SLEEP, "s0").effect is StepEffect.LEAVE
            async with EngineClient(e.url) as engine:  # the sleep step's command, as an agent's
                await engine.sleep(1)
            t0 = time.monotonic()
            await steps.settle()
            return time.monotonic() - t0, [i.worker_id for i in r.table]
        finally:
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
            await r.aclose()

    try:
        wait_healthy(procs)
        with caplog.at_level(logging.WARNING, logger="pearl.router.plan_steps"):
            settled_s, left = asyncio.run(run())
    finally:
        e.stop()
    assert left == [] and not caplog.records, caplog.text
    assert settled_s < 5.0, f"the aborts took {settled_s:.1f} s"


# -- the table's bookkeeping, no traffic -----------------------------------------------


def test_unknown_workers_failed_steps_and_undone_drains(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        r = Router()
        steps = PlanSteps(r)
        with caplog.at_level(logging.WARNING, "pearl.router.plan_steps"):
            for action in (A.DRAIN, A.MIGRATE, A.SWITCH, A.SLEEP, A.STOP):
                assert steps.start(action, "ghost").effect is None
        assert sum("ghost" in m for m in caplog.messages) == 5
        assert steps.end(A.START, "w0", R.DECODE, "http://127.0.0.1:9", ok=False).effect is None
        assert "w0" not in r.table  # a failed start joins nothing
        assert steps.end(A.SWITCH, "w0", R.DECODE).effect is None  # nowhere to route it
        assert steps.start(A.SYNC_WEIGHTS, "w0").effect is None  # not the router's
        steps.end(A.START, "w0", R.DECODE, "http://127.0.0.1:9/")
        assert r.table.get("w0").url == "http://127.0.0.1:9"
        # drain, then a stop that fails: the compensation brings it back in its old role
        steps.start(A.DRAIN, "w0")
        steps.start(A.STOP, "w0")
        await steps.settle()
        assert "w0" not in r.table
        assert steps.end(A.STOP, "w0", ok=False).effect is StepEffect.JOIN  # it did not stop
        assert steps.drain_undone("w0").effect is StepEffect.JOIN  # (and the drain's undo)
        w0 = r.table.get("w0")
        assert (w0.role, w0.phase, w0.url) == (R.DECODE, Phase.READY, "http://127.0.0.1:9")
        # a switch that fails: the worker kept its old role, and serves in it again
        steps.start(A.DRAIN, "w0")
        steps.start(A.SWITCH, "w0")
        assert r.table.get("w0").phase is Phase.SWITCHING
        assert steps.end(A.SWITCH, "w0", R.PREFILL, ok=False).effect is StepEffect.JOIN
        assert (w0.role, w0.phase) == (R.DECODE, Phase.READY)
        # a drain or a migration that fails (no compensation undoes those): the same
        for action in (A.DRAIN, A.MIGRATE):
            steps.start(action, "w0")
            assert r.table.get("w0").phase is Phase.DRAINING
            assert steps.end(action, "w0", ok=False).effect is StepEffect.JOIN
            assert (w0.role, w0.phase) == (R.DECODE, Phase.READY)
            steps.start(action, "w0")
            assert steps.end(action, "w0").effect is None  # done: it stays out
            assert r.table.get("w0").phase is Phase.DRAINING
            steps.drain_undone("w0")
        assert steps.drain_undone("ghost").effect is None
        # a trainer's start is not the router's
        assert steps.end(A.START, "t0", R.TRAIN, None).effect is None
        assert "t0" not in r.table
        await r.aclose()

    asyncio.run(run())


def test_lost_workers_leave_the_table_at_once_and_a_leave_under_way_ends() -> None:
    async def run() -> None:
        r = Router()
        steps = PlanSteps(r)
        steps.end(A.START, "w0", R.DECODE, "http://127.0.0.1:9")
        steps.end(A.START, "w1", R.DECODE, "http://127.0.0.1:10")
        steps.start(A.STOP, "w1")  # leaving: its aborts under way
        assert steps.lost(["w0", "w1", "ghost"]) == ["w0", "w1"]
        assert list(r.table) == [] and steps.lost(["w0"]) == []
        await steps.settle()  # the leave was cancelled: nothing comes back
        assert steps.drain_undone("w1").effect is None  # lost: no compensation brings it back
        await r.aclose()

    asyncio.run(run())


# -- over HTTP ---------------------------------------------------------------------------


def _step(sid: int, action: Action, worker: str, role: Role | None = None) -> PlanStep:
    gpu_type = "h800" if action in (A.START, A.WAKE) else ""  # as the planner says it
    return PlanStep(sid, action, worker, "n0", ("n0/0",), role, (), 1.0, 0.0, "test", gpu_type)


def _ok(sid: int, url: str | None = None) -> PlanStepResult:
    return PlanStepResult(sid, CommandStatus.OK, "a0", None, 0.5, 1.0, url)


def _completions(url: str, session: str, first: list[int], turns: int) -> None:
    prompt = list(first)
    with httpx.Client(timeout=120) as c:
        for t in range(turns):
            body = {"prompt": prompt, "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}
            resp = c.post(f"{url}/v1/completions", json=body, headers={"X-Session-Id": session})
            resp.raise_for_status()
            prompt = [*prompt, *resp.json()["choices"][0]["token_ids"], 11, 12 + t]


def test_the_listener_moves_a_running_fronts_table_while_trajectories_flow(
    engines: list[EngineProc], tiny_model_dir: Path
) -> None:
    from pearl.engines.reference.tokenizer import load

    e0, e1, e2 = engines
    with serving_front(lambda: router_over([e0], [R.COLOCATED]), load(tiny_model_dir)) as front:
        pool = ThreadPoolExecutor(4)
        runs = [pool.submit(_completions, front.url, f"s{i}", [70 + i, 8, 9], 3) for i in range(4)]

        def table() -> dict[str, dict[str, Any]]:
            got = httpx.get(f"{front.url}/pearl/instances").json()["instances"]
            return {i["worker_id"]: i for i in got}

        end = time.monotonic() + 20
        while table()["e0"]["in_flight"] < 2:
            assert time.monotonic() < end
            time.sleep(0.01)
        with RouterSteps(front.url) as listener:
            start, migrate = _step(0, A.START, "e1", R.COLOCATED), _step(1, A.MIGRATE, "e0")
            listener.step_started(start)
            listener.step_ended(start, _ok(0, e1.url))
            listener.step_started(migrate)
            listener.step_ended(migrate, _ok(1))
            listener.step_started(_step(2, A.STOP, "e0"))
            for done in runs:
                done.result(timeout=120)
            assert listener.dropped == 0
        pool.shutdown()
        assert table() == {
            "e1": {
                "worker_id": "e1",
                "url": e1.url,
                "role": "colocated",
                "phase": "ready",
                "in_flight": 0,
                "gpu_type": "h800",
                "tp": 1,
            }
        }
        records = [httpx.delete(f"{front.url}/sessions/s{i}").json() for i in range(4)]
    where = [t["served_by"] for rec in records for t in rec["turns"]]
    assert ["e0", "e1"] in where, "no turn was migrated"
    assert all(rec["turns"][-1]["served_by"] == ["e1"] for rec in records)  # after the plan
    for rec in records:
        assert len(rec["turns"]) == 3
        turns = [(t["prompt_ids"], t["token_ids"], t["served_by"]) for t in rec["turns"]]
        check_greedy(e2.url, turns)


BAD_BODIES = [
    ({"phase": "middle", "action": "drain", "worker_id": "w"}, "phase"),
    ({"phase": "start", "action": "explode", "worker_id": "w"}, "action"),
    ({"phase": "start", "action": "drain", "worker_id": ""}, "worker_id"),
    ({"phase": "start", "action": "drain"}, "worker_id"),
    ({"phase": "end", "action": "start", "worker_id": "w", "role": "boss"}, "role"),
    ({"phase": "end", "action": "start", "worker_id": "w", "role": "decode"}, "url"),
    ({"phase": "end", "action": "wake", "worker_id": "w", "url": "http://h:1"}, "role"),
    ({"phase": "end", "action": "start", "worker_id": "w", "url": "ftp://h"}, "url"),
    ({"phase": "end", "action": "stop", "worker_id": "w", "ok": "yes"}, "ok"),
    ({"phase": "start", "action": "abort_drain", "worker_id": "w"}, "phase"),
    ({"phase": "start", "action": "drain", "worker_id": "w", "force": True}, "force"),
    ({"phase": "end", "action": "start", "worker_id": "w", "gpu_type": ""}, "gpu_type"),
    ({"phase": "end", "action": "start", "worker_id": "w", "tp": 0}, "tp"),
    ({"phase": "end", "action": "start", "worker_id": "w", "tp": "4"}, "tp"),
    ([1, 2], "body"),
]


def test_bad_plan_step_bodies_are_400s_naming_the_field(tiny_model_dir: Path) -> None:
    from pearl.engines.reference.tokenizer import load

    with serving_front(Router, load(tiny_model_dir)) as front:
        url = f"{front.url}/pearl/plan_steps"
        for body, field in BAD_BODIES:
            resp = httpx.post(url, json=body)
            assert resp.status_code == 400, (body, resp.text)
            error = resp.json()["error"]
            assert (error["param"], error["code"]) == (field, 400), (body, error)
            assert error["message"].startswith(f"{field}: "), error
        resp = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "body"
        ok = httpx.post(url, json={"phase": "start", "action": "drain", "worker_id": "w"})
        assert ok.status_code == 200 and ok.json()["applied"] is None  # unknown: ignored
        assert httpx.get(f"{front.url}/pearl/instances").json() == {"instances": []}
        lost = f"{front.url}/pearl/workers_lost"
        for body, field in [({"worker_ids": "w"}, "worker_ids"), ({"worker_ids": [""]}, "0")]:
            resp = httpx.post(lost, json=body)
            assert resp.status_code == 400 and field in resp.json()["error"]["param"], resp.text
        resp = httpx.post(lost, json={"worker_ids": ["w"], "reason": "exited"})
        assert resp.status_code == 200 and resp.json() == {"removed": []}


def test_a_listener_whose_router_is_down_drops_the_step_and_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from pearl.control.workers import free_port

    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING), RouterSteps(f"http://127.0.0.1:{free_port()}") as ls:
        ls.step_started(_step(0, A.DRAIN, "e0"))
        ls.step_ended(_step(1, A.START, "e1", R.DECODE), _ok(1, "http://127.0.0.1:9"))
        ls.step_started(_step(2, A.SYNC_WEIGHTS, "e0"))  # nothing for the router: not posted
    assert ls.dropped == 2 and time.monotonic() - t0 < 5
    assert sum("dropped" in m for m in caplog.messages) == 2
