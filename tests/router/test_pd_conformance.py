"""The router's disaggregated flow against vLLM's disaggregated proxy
(``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` in the vLLM repository):
the same HTTP calls, in the same order, with the same fields.

Two real reference engines, one a prefill instance and one a decode instance, each behind
a recording HTTP proxy (``tests/recording_proxy.py``); the router's instance table points
at the proxies, so every call the router makes is recorded with its method, path,
headers, JSON body, status and answer. For a client's ``/v1/completions`` request R the
toy proxy makes exactly two calls, with one fresh request id X for both:

1. ``POST /v1/completions`` to a prefill instance, header ``X-Request-Id: X``, body R
   with ``kv_transfer_params`` set to ``{do_remote_decode: true, do_remote_prefill:
   false, remote_engine_id, remote_block_ids, remote_host, remote_port: null}``,
   ``stream: false``, ``max_tokens: 1`` (``max_completion_tokens: 1`` where R has it) and
   no ``stream_options``;
2. once that is answered, ``POST /v1/completions`` to a decode instance, header
   ``X-Request-Id: X``, body R (as the client sent it) with ``kv_transfer_params`` set to
   those of the prefill's answer.

:func:`toy_prefill` and :func:`toy_decode` state that; each test checks the recorded calls
against them, R being the request pearl means for the turn (:func:`pearl_request`). Where
pearl differs on purpose, the tests assert pearl's behaviour (docs/router.md, "Conformance
with vLLM's disaggregated proxy", lists the differences and why): R carries pearl's own
fields (token-id prompt, ``logprobs: 0``, ``return_token_ids``); ``stream`` is left out
of the prefill (vLLM's default, false) and the decode is not streamed; no
``Authorization`` header; instances are chosen by load and prefix, not round-robin; and a
prefill that finds no decode instance accepting frees its held KV (``POST
/abort_requests`` on the prefill instance) before the turn is routed again. ``GET
/metrics`` scrapes are the router's own reading of the instances and are left out of the
sequence."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from engine_procs import EngineProc, running_engines
from recording_proxy import Call, RecordingProxies

from pearl.core.roles import Role
from pearl.router.router import Router, Sampling, Turn

# the prefill's kv_transfer_params in toy_proxy_server.py
TOY_PREFILL_KV: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
COMPLETIONS = ("POST", "/v1/completions")


def toy_prefill(request: dict[str, Any]) -> dict[str, Any]:
    """The body toy_proxy_server.py sends the prefill instance for the client's request."""
    body = {k: v for k, v in request.items() if k != "stream_options"}
    body |= {"kv_transfer_params": dict(TOY_PREFILL_KV), "stream": False, "max_tokens": 1}
    if "max_completion_tokens" in request:
        body["max_completion_tokens"] = 1
    return body


def toy_decode(request: dict[str, Any], prefill_kv: dict[str, Any] | None) -> dict[str, Any]:
    """The body it sends the decode instance: the client's, with the prefill's answer's
    ``kv_transfer_params`` (where there are any)."""
    return {**request, "kv_transfer_params": prefill_kv} if prefill_kv else dict(request)


def pearl_request(prompt: list[int], s: Sampling) -> dict[str, Any]:
    """The request pearl means for a turn (what a client of the toy proxy would send)."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "logprobs": 0,
        "return_token_ids": True,
        "ignore_eos": s.ignore_eos,
    }
    if s.seed is not None:
        body["seed"] = s.seed
    return body


def without_scrapes(calls: list[Call]) -> list[Call]:
    return [c for c in calls if (c.method, c.path) != ("GET", "/metrics")]


def check_turn(calls: list[Call], request: dict[str, Any]) -> tuple[Call, Call]:
    """``calls`` are one disaggregated turn of ``request``, as the toy proxy makes it."""
    assert [(c.instance, c.method, c.path) for c in calls] == [
        ("p0", *COMPLETIONS),
        ("d0", *COMPLETIONS),
    ], calls
    prefill, decode = calls
    # the prefill: the toy proxy's overrides, and only those
    assert prefill.body["kv_transfer_params"] == TOY_PREFILL_KV
    assert prefill.body["max_tokens"] == 1
    assert "stream_options" not in prefill.body and "max_completion_tokens" not in prefill.body
    assert prefill.body.get("stream", False) is False  # pearl: left out, vLLM's default
    expected = toy_prefill(request)
    assert {**prefill.body, "stream": False} == expected
    assert prefill.status == 200
    # the decode: sent once the prefill was answered, carrying exactly its kv_transfer_params
    kv = prefill.kv_transfer_params
    assert kv and kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert decode.arrived > prefill.answered
    assert decode.body["kv_transfer_params"] == kv
    assert decode.body == toy_decode(request, kv)
    assert decode.body.get("stream", False) is False  # pearl: a JSON answer, not a stream
    assert isinstance(decode.response, dict) and decode.status == 200
    # one request id for both calls, as the toy proxy's; pearl sends no Authorization
    rid = prefill.headers["x-request-id"]
    assert rid and decode.headers["x-request-id"] == rid
    assert "authorization" not in prefill.headers and "authorization" not in decode.headers
    assert prefill.headers["content-type"] == decode.headers["content-type"] == "application/json"
    return prefill, decode


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[EngineProc]]:
    with running_engines(
        tiny_model_dir, tmp_path_factory.mktemp("pd-conformance-engines"), ("p0", "d0")
    ) as procs:
        yield procs


@pytest.fixture(scope="module")
def proxies(engines: list[EngineProc]) -> Iterator[RecordingProxies]:
    with RecordingProxies({e.name: e.url for e in engines}) as rec:
        yield rec


@pytest.fixture()
def rec(proxies: RecordingProxies) -> RecordingProxies:
    proxies.take()  # what an earlier test left
    return proxies


def _router(rec: RecordingProxies, ready: tuple[str, ...] = ("p0", "d0")) -> Router:
    r = Router()
    r.table.add("p0", rec.urls["p0"], Role.PREFILL)
    r.table.add("d0", rec.urls["d0"], Role.DECODE)
    for wid in ready:
        r.table.ready(wid)
    return r


def test_each_disaggregated_turn_makes_the_toy_proxys_two_calls(rec: RecordingProxies) -> None:
    samplings = [
        Sampling(max_tokens=6, temperature=0.0, ignore_eos=True),
        Sampling(max_tokens=9, temperature=0.0, ignore_eos=True, seed=7),
        Sampling(max_tokens=12, temperature=0.7, top_p=0.9, ignore_eos=True, seed=3),
    ]
    prompts = [[9, 8, 7, 6, 5], [40, 41, 42, 43, 44, 45, 46, 47, 48], [3, 1, 4, 1, 5, 9, 2, 6]]

    async def run() -> list[tuple[list[Call], int]]:
        r = _router(rec)
        turns = []
        try:
            for i, (prompt, s) in enumerate(zip(prompts, samplings, strict=True)):
                await r.scrape()  # the router reads /metrics too: left out below
                got = await r.generate(Turn(f"t{i}", tuple(prompt), s, f"t{i}-0"))
                assert got.prefilled_by == ["p0"] and got.served_by == ["d0"]
                turns.append((rec.take(), len(got.token_ids)))
        finally:
            await r.aclose()
        return turns

    turns = asyncio.run(run())
    for (calls, n_tokens), prompt, s in zip(turns, prompts, samplings, strict=True):
        assert any(c.path == "/metrics" for c in calls), "the scrape was not recorded"
        _, decode = check_turn(without_scrapes(calls), pearl_request(prompt, s))
        assert n_tokens == s.max_tokens == len(decode.response["choices"][0]["token_ids"])
    rids = [without_scrapes(calls)[0].headers["x-request-id"] for calls, _ in turns]
    assert len(set(rids)) == len(rids), "a request id was used for two turns"


def test_a_multi_turn_trajectory_repeats_the_sequence_turn_after_turn(
    rec: RecordingProxies,
) -> None:
    s = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def run() -> list[tuple[list[int], list[Call]]]:
        r = _router(rec)
        prompt, turns = [5, 6, 7, 8, 9, 10], []
        try:
            for t in range(3):
                got = await r.generate(Turn("m0", tuple(prompt), s, f"m0-{t}"))
                turns.append((prompt, rec.take()))
                prompt = [*prompt, *got.token_ids, 11, 12 + t]  # + an observation
        finally:
            await r.aclose()
        return turns

    turns = asyncio.run(run())
    for prompt, calls in turns:
        check_turn(without_scrapes(calls), pearl_request(prompt, s))
    assert [len(p) for p, _ in turns] == [6, 6 + 8 + 2, 6 + 2 * (8 + 2)]


def test_concurrent_turns_pair_up_by_request_id(rec: RecordingProxies) -> None:
    s = Sampling(max_tokens=6, temperature=0.0, ignore_eos=True)
    firsts = [[20 + i, 3, 4, 5] for i in range(4)]

    async def trajectory(r: Router, i: int) -> list[list[int]]:
        prompt, prompts = list(firsts[i]), []
        for t in range(2):
            got = await r.generate(Turn(f"c{i}", tuple(prompt), s, f"c{i}-{t}"))
            prompts.append(prompt)
            prompt = [*prompt, *got.token_ids, 11]
        return prompts

    async def run() -> list[list[list[int]]]:
        r = _router(rec)
        try:
            return await asyncio.gather(*(trajectory(r, i) for i in range(len(firsts))))
        finally:
            await r.aclose()

    prompts = {tuple(p) for traj in asyncio.run(run()) for p in traj}
    calls = without_scrapes(rec.take())
    by_rid: dict[str, list[Call]] = {}
    for c in calls:
        by_rid.setdefault(c.headers["x-request-id"], []).append(c)
    assert len(by_rid) == len(prompts) == 8 and len(calls) == 16
    for pair in by_rid.values():
        prefill, _ = check_turn(pair, pearl_request(pair[0].body["prompt"], s))
        assert tuple(prefill.body["prompt"]) in prompts


def test_no_decode_instance_frees_the_prefills_kv_then_routes_again(
    rec: RecordingProxies,
) -> None:
    """pearl's own step, which the toy proxy (a fixed pool) has no need of: the decode
    instance stops accepting while the prefill is in flight (a plan is changing the
    pools), so when the prefill is answered the router aborts it on its instance (freeing
    the KV held for a decode), parks the turn, and prefills it again once a decode
    instance accepts."""
    s = Sampling(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [7, 7, 8, 8, 9, 9]

    async def run() -> list[Call]:
        r = _router(rec)
        gate = rec.hold("p0", "/v1/completions")
        try:
            task = asyncio.ensure_future(r.generate(Turn("f0", tuple(prompt), s, "f0-0")))
            while not gate.reached.is_set():  # the prefill is done, its answer held
                await asyncio.sleep(0.01)
            r.table.drain("d0")
            gate.release.set()
            while not any(c.path == "/abort_requests" for c in rec.peek()):
                assert not task.done()
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert not task.done()  # parked: no entry without a decode instance
            r.table.ready("d0")
            got = await asyncio.wait_for(task, 60)
            assert got.prefilled_by == ["p0", "p0"] and got.served_by == ["d0"]
            assert len(got.token_ids) == s.max_tokens
        finally:
            gate.release.set()
            await r.aclose()
        return rec.take()

    calls = without_scrapes(asyncio.run(run()))
    assert [(c.instance, c.path) for c in calls] == [
        ("p0", "/v1/completions"),
        ("p0", "/abort_requests"),
        ("p0", "/v1/completions"),
        ("d0", "/v1/completions"),
    ]
    held, abort, prefill, decode = calls
    check_turn([prefill, decode], pearl_request(prompt, s))
    assert held.body == prefill.body and held.kv_transfer_params  # its KV was held
    assert abort.method == "POST" and abort.arrived > held.answered
    assert abort.body == {"request_ids": [held.headers["x-request-id"]]}
    assert abort.response == {"aborted": 1}  # the held KV was there, and is freed
    assert held.headers["x-request-id"] != prefill.headers["x-request-id"]  # a new request
