"""The router over real reference engines (processes, HTTP): colocated and disaggregated
multi-turn trajectories, plan steps while traffic flows (P:D change and back), migration
of a turn in flight, and the OpenAI-compatible front driven by the ``openai`` SDK.

Greedy decoding makes a turn's output independent of where it runs, so every check is
against the same turn run directly on one engine: routing, PD handoffs, role switches and
migrations must not change a token, lose a turn or generate a token twice."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from engine_procs import EngineProc, running_engines
from router_turns import (
    GREEDY,
    Turns,
    check_greedy,
    direct,
    router_over,
    serving_front,
    trajectory,
)

from pearl.core.roles import Role
from pearl.engines.client import EngineClient
from pearl.io.documents import load_profile
from pearl.router.router import Router, Sampling, Turn


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[EngineProc]]:
    with running_engines(
        tiny_model_dir, tmp_path_factory.mktemp("router-engines"), ("e0", "e1", "e2")
    ) as procs:
        yield procs


def test_colocated_turns_stay_home_and_match_a_direct_run(engines: list[EngineProc]) -> None:
    async def run() -> list[Turns]:
        r = router_over(engines[:2], [Role.COLOCATED, Role.COLOCATED])
        try:
            return await asyncio.gather(
                *(trajectory(r, f"c{i}", [5 + i, 6, 7, 8], 3) for i in range(4))
            )
        finally:
            await r.aclose()

    trajs = asyncio.run(run())
    homes = set()
    for turns in trajs:
        served = {w for _, _, by in turns for w in by}
        assert len(served) == 1, f"a trajectory left its home: {turns}"
        homes |= served
        assert all(len(tokens) == GREEDY.max_tokens for _, tokens, _ in turns)
        check_greedy(engines[0].url, turns)
    assert homes == {"e0", "e1"}  # first turns spread over both (least loaded)


def test_a_disaggregated_turn_prefills_on_one_and_decodes_on_another(
    engines: list[EngineProc],
) -> None:
    async def run() -> tuple[Turns, float, float]:
        r = router_over(engines[:2], [Role.PREFILL, Role.DECODE])
        async with EngineClient(engines[1].url) as c:
            before = (await c.metrics()).get("pearl:prompt_tokens_computed_total", 0.0)
            try:
                turns = await trajectory(r, "d0", [9, 8, 7, 6, 5, 4, 3, 2, 1], 2)
            finally:
                await r.aclose()
            after = (await c.metrics()).get("pearl:prompt_tokens_computed_total", 0.0)
        return turns, before, after

    turns, before, after = asyncio.run(run())
    assert all(by == ["e0", "e1"] for _, _, by in turns)  # prefilled on e0, decoded on e1
    assert after == before  # and computed no prompt token: the KV came from e0
    check_greedy(engines[2].url, turns)


def test_a_pd_change_under_load_loses_nothing(engines: list[EngineProc]) -> None:
    """Eight trajectories run while the plan turns two colocated instances into a prefill
    and a decode one (drain, switch) and back, each phase serving turns; every turn
    finishes with the tokens a direct run gives."""

    async def turns_pass(r: Router, n: int) -> None:
        target = r.turns_done + n
        while r.turns_done < target:
            await asyncio.sleep(0.01)

    async def run() -> list[Turns]:
        r = router_over(engines[:2], [Role.COLOCATED, Role.COLOCATED])
        sampling = Sampling(max_tokens=16, temperature=0.0, ignore_eos=True)
        load = [
            asyncio.ensure_future(trajectory(r, f"m{i}", [20 + i, 3, 4], 6, sampling))
            for i in range(8)
        ]
        try:
            await turns_pass(r, 8)
            for wid, role in (("e0", Role.PREFILL), ("e1", Role.DECODE)):
                await r.drain(wid, timeout_s=60)
                r.table.switch(wid, role)
            await turns_pass(r, 8)
            for wid in ("e1", "e0"):
                await r.drain(wid, timeout_s=60)
                r.table.switch(wid, Role.COLOCATED)
            return await asyncio.gather(*load)
        finally:
            await r.aclose()

    trajs = asyncio.run(run())
    assert len(trajs) == 8 and all(len(t) == 6 for t in trajs)
    where = [by for turns in trajs for _, _, by in turns]
    assert ["e0", "e1"] in where, "no turn ran disaggregated"
    assert any(len(by) == 1 for by in where), "no turn ran colocated"
    for turns in trajs:
        check_greedy(engines[2].url, turns)


def test_migration_continues_a_turn_elsewhere_with_the_same_tokens(
    engines: list[EngineProc],
) -> None:
    long = Sampling(max_tokens=1200, temperature=0.0, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    async def run() -> tuple[list[int], list[str], int, int]:
        r = router_over(engines[:1], [Role.COLOCATED])
        try:
            task = asyncio.ensure_future(r.generate(Turn("g0", tuple(prompt), long, "g0-0")))
            await asyncio.sleep(0.05)
            while not r.table.get("e0").in_flight:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # some tokens in, most to come
            r.table.add("e1", engines[1].url, Role.COLOCATED)
            r.table.ready("e1")
            aborted = await r.migrate("e0", timeout_s=30)
            out = await asyncio.wait_for(task, 60)
            return out.token_ids, out.served_by, out.continuations, aborted
        finally:
            await r.aclose()

    tokens, served_by, continuations, aborted = asyncio.run(run())
    assert aborted == 1 and continuations == 1 and served_by == ["e0", "e1"]
    assert tokens == asyncio.run(direct(engines[2].url, prompt, 1200))


def test_an_openai_sdk_agent_runs_through_the_front(
    engines: list[EngineProc], tiny_model_dir: Path
) -> None:
    openai = pytest.importorskip("openai")
    import httpx

    from pearl.engines.reference.tokenizer import load

    def make() -> Router:
        return router_over(engines[:2], [Role.COLOCATED, Role.COLOCATED])

    with serving_front(make, load(tiny_model_dir)) as front:
        client = openai.OpenAI(base_url=f"{front.url}/v1", api_key="none")
        messages = [{"role": "user", "content": "What is two plus two?"}]
        headers = {"X-Session-Id": "sdk-1"}
        for _ in range(2):
            resp = client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=8,
                temperature=0.0,
                extra_headers=headers,
            )
            assert resp.choices[0].message.role == "assistant"
            messages += [
                {"role": "assistant", "content": resp.choices[0].message.content or ""},
                {"role": "user", "content": "and then?"},
            ]
        record = httpx.delete(f"{front.url}/sessions/sdk-1").json()
    assert len(record["turns"]) == 2
    for turn in record["turns"]:
        assert 0 < len(turn["token_ids"]) <= 8
        assert len(turn["logprobs"]) == len(turn["token_ids"]) == len(turn["versions"])
    # the second turn's prompt starts with the first turn's: one session, one home
    assert record["turns"][0]["served_by"] == record["turns"][1]["served_by"]


def test_turns_beyond_an_engines_slots_wait_at_the_router(engines: list[EngineProc]) -> None:
    """An engine that runs one sequence at once (its profile's max_num_seqs): three
    trajectories at a time through it never have more than one request there; the others
    wait parked at the router and go as each comes back, every turn as a direct run."""
    one_slot = load_profile("qwen3-8b").engine("h100", 1)
    assert one_slot is not None
    r = Router()
    inst = r.table.add(
        "e0", engines[0].url, Role.COLOCATED, one_slot.model_copy(update={"max_num_seqs": 1})
    )
    r.table.ready("e0")
    most = [0]
    sent = inst.sent

    def counted(req: Any) -> None:
        sent(req)
        most[0] = max(most[0], inst.load)

    inst.sent = counted  # type: ignore[method-assign]

    async def run() -> list[Turns]:
        try:
            return await asyncio.gather(
                *(trajectory(r, f"s{i}", [5 + i, 6, 7], 2) for i in range(3))
            )
        finally:
            await r.aclose()

    trajs = asyncio.run(run())
    assert most[0] == 1
    for turns in trajs:
        assert len(turns) == 2 and all(len(out) == GREEDY.max_tokens for _, out, _ in turns)
        check_greedy(engines[0].url, turns)
