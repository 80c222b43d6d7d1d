"""vLLM's HTTP protocol, as pearl's engines must speak it, over real HTTP to real servers.

By default the module starts reference-engine processes (``pearl engine serve``, see
``engine_procs.py``) once for all its tests: ``engine`` and ``peer`` (the two sides of a
prefill/decode hand-off), ``small_kv`` (a 256-token KV cache, to force preemption, and a
1 s KV lease) and ``sleeper`` (a larger model, so that sleep shows in its RSS). With
``--engine-url URL --peer-url URL`` the tests run against engines already running (two
``vllm serve``, ``scripts/device-check``); what only the reference engine has (a local
pid's RSS, ``pearl:`` metrics, the weight push with a body, instances of its own) is then
skipped. Tests that change an engine's state (pause, weights) put it back.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

pytest.importorskip("torch", reason="needs the engine extra: pip install 'pearl[engine]'")

from engine_procs import (
    EngineProc,
    kv_bytes_per_token,
    rss_bytes,
    start_engine,
    wait_healthy,
    weights_nbytes,
)

from pearl.engines.client import EngineClient, EngineError

T = TypeVar("T")
JSON = dict[str, Any]
TIMEOUT_S = 60.0
SMALL_KV_TOKENS = 256
SLEEPER_KV_BYTES = 64 << 20
# init_model's default std (0.02) makes a model whose greedy output repeats the prompt's
# last token whatever its weights (the residual stream is the token's own embedding, and
# the head is tied): greedy equalities would hold vacuously. Larger weights give outputs
# that depend on every weight and position.
STD = 0.3


def arun(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


@dataclass
class Engines:
    engine: EngineProc
    peer: EngineProc
    small_kv: EngineProc | None
    sleeper: EngineProc | None
    model: str  # the served model name
    model_dir: Path | None  # where its files are (this machine's path), if known
    vocab: int
    max_model_len: int

    @property
    def reference(self) -> bool:
        return self.engine.local


def _model_info(url: str) -> tuple[str, Path | None, int]:
    card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    root = Path(card["root"]) if card.get("root") else None
    return card["id"], root, int(card.get("max_model_len") or 1024)


@pytest.fixture(scope="module")
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engines]:
    url, peer_url = request.config.getoption("--engine-url"), request.config.getoption("--peer-url")
    if url or peer_url:
        if not (url and peer_url):
            pytest.fail("--engine-url and --peer-url go together")
        name, root, max_len = _model_info(url)
        vocab = 512
        if root is not None and (root / "config.json").is_file():
            vocab = int(json.loads((root / "config.json").read_text())["vocab_size"])
        yield Engines(
            EngineProc(url, "engine"),
            EngineProc(peer_url, "peer"),
            None,
            None,
            name,
            root,
            vocab,
            max_len,
        )
        return
    from pearl.engines.reference.tiny import init_model

    logs = tmp_path_factory.mktemp("engine-logs")
    models = tmp_path_factory.mktemp("models")
    tiny = init_model(models / "conformance", std=STD)
    big = init_model(
        models / "sleeper", layers=8, hidden=256, intermediate=1792, vocab=2048, std=STD
    )
    kv_tokens = SLEEPER_KV_BYTES // kv_bytes_per_token(big)
    procs = [
        start_engine(tiny, logs, "engine", "--max-model-len", "1024"),
        start_engine(tiny, logs, "peer", "--max-model-len", "1024"),
        start_engine(
            tiny,
            logs,
            "small",
            "--kv-cache-tokens",
            str(SMALL_KV_TOKENS),
            "--max-model-len",  # a sequence of the longest length fits the cache
            str(SMALL_KV_TOKENS),
            "--block-size",
            "16",
            "--kv-lease-s",
            "1",
        ),
        start_engine(big, logs, "sleeper", "--kv-cache-tokens", str(kv_tokens)),
    ]
    try:
        wait_healthy(procs)
        name, _, max_len = _model_info(procs[0].url)
        yield Engines(procs[0], procs[1], procs[2], procs[3], name, tiny, 512, max_len)
    finally:
        for p in procs:
            p.stop()
        if request.session.testsfailed:
            for p in procs:
                print(p.log_tail())


@pytest.fixture
def E(engines: Engines) -> Engines:
    return engines


def _need_reference(e: Engines, what: str) -> None:
    if not e.reference:
        pytest.skip(f"{what}: only the reference engine started here has it")


def _same_shape_model(e: Engines, out: Path, *, seed: int, std: float) -> Path:
    """A model of the engine's shapes (read from its config) with other random weights;
    the tokenizer is the same (init_model's is fixed by the vocabulary size)."""
    from pearl.engines.reference.tiny import init_model

    assert e.model_dir is not None
    cfg = json.loads((e.model_dir / "config.json").read_text())
    return init_model(
        out,
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        intermediate=cfg["intermediate_size"],
        vocab=cfg["vocab_size"],
        max_position_embeddings=cfg["max_position_embeddings"],
        seed=seed,
        std=std,
    )


def _prompt(seed: int, n: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, min(vocab, 500)) for _ in range(n)]


def greedy(e: Engines, prompt: list[int] | str, max_tokens: int, **kw: Any) -> JSON:
    body: JSON = {
        "model": e.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return {**body, **kw}


def ids_of(choice: JSON) -> list[int]:
    return list(choice["token_ids"])


async def _counter(c: EngineClient, name: str) -> float:
    return (await c.metrics()).get(name, 0.0)


async def _poll(fn: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await fn():
            return True
        await asyncio.sleep(0.05)
    return False


async def _stream(
    c: EngineClient, body: JSON, request_id: str | None = None
) -> tuple[list[JSON], str, list[int]]:
    """Every event of a streamed completion, its text and its token ids."""
    events: list[JSON] = []
    text, ids = "", list[int]()
    async for ev in c.stream_completions(body, request_id=request_id):
        events.append(ev)
        for ch in ev["choices"]:
            text += ch.get("text") or ""
            ids += ch.get("token_ids") or []
    return events, text, ids


def _finish(events: list[JSON]) -> str | None:
    reasons = [ch.get("finish_reason") for ev in events for ch in ev["choices"]]
    return next((r for r in reversed(reasons) if r is not None), None)


# -- 1. completions -----------------------------------------------------------------------


def test_completions_text_and_ids_streamed_and_not(E: Engines) -> None:
    async def main() -> None:
        async with EngineClient(E.engine.url, timeout_s=TIMEOUT_S) as c:
            for prompt in ("The quick brown fox", _prompt(1, 12)):
                body = greedy(E, prompt, 8, logprobs=2)
                out = await c.completions(body, request_id="conf-text-1")
                assert out["id"] == "cmpl-conf-text-1"
                assert out["object"] == "text_completion"
                (ch,) = out["choices"]
                ids = ids_of(ch)
                assert len(ids) == 8 and ch["finish_reason"] == "length"
                lp = ch["logprobs"]
                assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 8
                assert len(lp["top_logprobs"]) == 8
                assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])
                assert all(x <= 0.0 for x in lp["token_logprobs"])
                u = out["usage"]
                assert u["completion_tokens"] == 8
                assert u["total_tokens"] == u["prompt_tokens"] + 8
                if isinstance(prompt, list):
                    assert u["prompt_tokens"] == len(prompt)
                events, text, sids = await _stream(c, body, request_id="conf-stream-1")
                assert all(ev["id"] == "cmpl-conf-stream-1" for ev in events)
                assert text == ch["text"] and sids == ids
                assert _finish(events) == "length"
                as_ids = await c.completions({**body, "return_tokens_as_token_ids": True})
                toks = as_ids["choices"][0]["logprobs"]["tokens"]
                assert toks == [f"token_id:{t}" for t in ids]

    arun(main())


def test_stream_sends_token_ids_while_a_character_is_incomplete(
    E: Engines, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A token that ends inside a UTF-8 character holds back its text, not its token id:
    a client that streams token ids (to abort after k of them, say) gets each as it is
    made. The default-std tiny model (same shapes and tokenizer) repeats the prompt's last
    token, here a lone byte of a multi-byte character."""
    if E.model_dir is None:
        pytest.skip("the engine's model directory is not known here")
    model_dir = E.model_dir
    from pearl.engines.reference.tokenizer import load

    tok = load(model_dir)
    byte = next(t for t in range(E.vocab) if tok.decode([t, t, t]).endswith("\ufffd"))
    repeater = _same_shape_model(E, tmp_path_factory.mktemp("models") / "std002", seed=0, std=0.02)

    async def main() -> None:
        async with EngineClient(E.engine.url, timeout_s=TIMEOUT_S) as c:
            await c.reload_weights(weights_path=str(repeater))
            try:
                body = greedy(E, [*_prompt(2, 8), byte], 12)
                whole = (await c.completions(body))["choices"][0]
                if ids_of(whole) != [byte] * 12 and not E.reference:
                    pytest.skip("this model does not repeat the prompt's last token")
                assert ids_of(whole) == [byte] * 12  # the premise: it repeats the byte
                events, text, ids = await _stream(c, body)
                assert ids == ids_of(whole) and text == whole["text"]
                carrying = [ev for ev in events if any(ch.get("token_ids") for ch in ev["choices"])]
                assert len(carrying) > 1, "every token id held back to the end"
            finally:
                await c.reload_weights(weights_path=str(model_dir))

    arun(main())


# -- 2. chat ------------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_chat_completions_with_and_without_tools(E: Engines) -> None:
    async def main() -> None:
        async with EngineClient(E.engine.url, timeout_s=TIMEOUT_S) as c:
            base = {
                "model": E.model,
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "What is the weather in Paris?"},
                ],
                "max_tokens": 6,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            out = await c.chat_completions(base, request_id="conf-chat-1")
            assert out["id"] == "chatcmpl-conf-chat-1" and out["object"] == "chat.completion"
            (ch,) = out["choices"]
            assert ch["message"]["role"] == "assistant"
            assert isinstance(ch["message"]["content"], str)
            assert ch["finish_reason"] == "length"
            assert out["usage"]["completion_tokens"] == 6
            plain_prompt = out["usage"]["prompt_tokens"]
            # the template wraps messages: more prompt tokens than the message text alone
            raw = await c.completions(greedy(E, "What is the weather in Paris?", 1))
            assert plain_prompt > raw["usage"]["prompt_tokens"]

            tooled = await c.chat_completions({**base, "tools": TOOLS, "tool_choice": "auto"})
            (tch,) = tooled["choices"]
            msg = tch["message"]
            assert msg["role"] == "assistant"
            assert msg.get("content") is None or isinstance(msg["content"], str)
            assert isinstance(msg.get("tool_calls") or [], list)
            assert tch["finish_reason"] in ("length", "stop", "tool_calls")
            # the tools went through the chat template into the prompt
            assert tooled["usage"]["prompt_tokens"] > plain_prompt

            chunks = [e async for e in c.stream_chat_completions(base)]
            content = "".join(
                ch["delta"].get("content") or "" for e in chunks for ch in e["choices"]
            )
            assert content == ch["message"]["content"]

    arun(main())


# -- 3. continuous batching ------------------------------------------------------------------


def test_continuous_batching_second_request_joins_the_running_batch(E: Engines) -> None:
    async def main() -> None:
        async with EngineClient(E.engine.url, timeout_s=TIMEOUT_S) as c:
            order: list[str] = []
            max_running = 0.0
            started = asyncio.Event()

            async def long() -> None:
                n = 0
                body = greedy(E, _prompt(3, 10), 400)
                async for ev in c.stream_completions(body):
                    n += sum(len(ch.get("token_ids") or []) for ch in ev["choices"])
                    if n >= 3:
                        started.set()
                assert n == 400
                order.append("long")

            async def short() -> None:
                await started.wait()
                out = await c.completions(greedy(E, _prompt(4, 10), 40))
                assert len(ids_of(out["choices"][0])) == 40
                order.append("short")

            async def poll() -> None:
                nonlocal max_running
                await started.wait()
                while "long" not in order:
                    max_running = max(max_running, await c.num_requests_running())
                    await asyncio.sleep(0.005)

            await asyncio.gather(long(), short(), poll())
            assert order == ["short", "long"]
            assert max_running == 2

    arun(main())


# -- 4. prefix reuse ------------------------------------------------------------------------


def test_prefix_cache_reuses_the_first_turn(E: Engines) -> None:
    async def main() -> None:
        async with EngineClient(E.engine.url, timeout_s=TIMEOUT_S) as c:
            turn1 = _prompt(5, 40)
            out1 = await c.completions(greedy(E, turn1, 8))
            turn2 = turn1 + ids_of(out1["choices"][0]) + _prompt(6, 10)
            before = await c.metrics()
            await c.completions(greedy(E, turn2, 4))

            async def grown() -> bool:
                now = await c.metrics()
                return now.get("vllm:prefix_cache_hits_total", 0) > before.get(
                    "vllm:prefix_cache_hits_total", 0
                )

            await _poll(grown)
            after = await c.metrics()
            hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
            assert hits >= len(turn1) // 16 * 16
            if E.reference:
                key = "pearl:prompt_tokens_computed_total"
                assert after[key] - before[key] < len(turn2)

    arun(main())


# -- 5. prefill/decode hand-off ------------------------------------------------------------


def _prefill_body(e: Engines, prompt: list[int]) -> JSON:
    return greedy(
        e,
        prompt,
        1,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )


def test_pd_handoff_between_two_processes(E: Engines) -> None:
    async def main() -> None:
        async with (
            EngineClient(E.engine.url, timeout_s=TIMEOUT_S) as a,
            EngineClient(E.peer.url, timeout_s=TIMEOUT_S) as b,
        ):
            prompt = _prompt(7, 37)
            colocated = ids_of((await a.completions(greedy(E, prompt, 10)))["choices"][0])
            pre = await a.completions(_prefill_body(E, prompt), request_id="conf-pd-1")
            kv = pre["kv_transfer_params"]
            assert kv["do_remote_prefill"] is True
            for k in ("remote_engine_id", "remote_request_id", "remote_block_ids"):
                assert kv[k], k
            assert kv["remote_host"] and kv["remote_port"]
            before = await b.metrics()
            out = await b.completions(greedy(E, prompt, 10, kv_transfer_params=kv))
            assert ids_of(out["choices"][0]) == colocated
            after = await b.metrics()
            if E.reference:
                key = "pearl:prompt_tokens_computed_total"
                assert after[key] == before[key]
            moved = "vllm:nixl_bytes_transferred_total"
            assert after.get(moved, 0) > before.get(moved, 0)

            if E.reference:  # vLLM falls back to a local prefill (kv_load_failure_policy)
                with pytest.raises(EngineError) as again:
                    await b.completions(greedy(E, prompt, 4, kv_transfer_params=kv))
                assert again.value.status == 400
                from pearl.control.workers import free_port

                nowhere = {**kv, "remote_port": free_port()}
                r = httpx.post(
                    f"{E.peer.url}/v1/completions",
                    json=greedy(E, prompt, 4, kv_transfer_params=nowhere),
                    timeout=TIMEOUT_S,
                )
                assert r.status_code == 400 and r.json()["error"]["message"]

    arun(main())


def test_pd_held_kv_expires_after_its_lease(E: Engines) -> None:
    if E.small_kv is None:
        pytest.skip("needs a reference instance started with --kv-lease-s 1")
    small = E.small_kv

    async def main() -> None:
        async with (
            EngineClient(small.url, timeout_s=TIMEOUT_S) as s,
            EngineClient(E.peer.url, timeout_s=TIMEOUT_S) as b,
        ):
            prompt = _prompt(8, 20)
            pre = await s.completions(_prefill_body(E, prompt))
            kv = pre["kv_transfer_params"]
            usage_held = (await s.metrics())["vllm:kv_cache_usage_perc"]
            assert usage_held > 0
            await asyncio.sleep(2.2)  # the lease (1 s) and the engine's idle check (1 s)
            with pytest.raises(EngineError) as gone:
                await b.completions(greedy(E, prompt, 4, kv_transfer_params=kv))
            assert gone.value.status == 400
            assert (await s.metrics())["vllm:kv_cache_usage_perc"] == 0

    arun(main())


# -- 6. abort and continuation ---------------------------------------------------------------


def test_abort_keeps_partial_output_and_a_continuation_completes_it(E: Engines) -> None:
    async def main() -> None:
        async with (
            EngineClient(E.engine.url, timeout_s=TIMEOUT_S) as a,
            EngineClient(E.peer.url, timeout_s=TIMEOUT_S) as b,
        ):
            n = 200
            prompt = _prompt(9, 16)
            rid = f"conf-abort-{random.randrange(1 << 30)}"
            partial: list[int] = []
            finish, sent = None, False
            async for ev in a.stream_completions(greedy(E, prompt, n), request_id=rid):
                for ch in ev["choices"]:
                    partial += ch.get("token_ids") or []
                    finish = ch.get("finish_reason") or finish
                if len(partial) >= 5 and finish is None and not sent:
                    sent = True
                    await a.abort_requests([rid])
            assert finish == "abort"
            k = len(partial)
            assert 0 < k < n
            cont = await b.completions(greedy(E, prompt + partial, n - k))
            full = await b.completions(greedy(E, prompt, n))
            assert partial + ids_of(cont["choices"][0]) == ids_of(full["choices"][0])

    arun(main())


# -- 7. sleep and wake ---------------------------------------------------------------------


def test_sleep_frees_kv_then_weights_and_wake_restores(E: Engines) -> None:
    if E.sleeper is None:
        pytest.skip("the RSS of a local engine process: only the reference engine here")
    s = E.sleeper
    assert s.pid is not None and s.model_dir is not None
    pid = s.pid
    kv = (SLEEPER_KV_BYTES // kv_bytes_per_token(s.model_dir)) * kv_bytes_per_token(s.model_dir)
    weights = weights_nbytes(s.model_dir)

    async def main() -> None:
        async with EngineClient(s.url, timeout_s=TIMEOUT_S) as c:
            body = {**greedy(E, _prompt(10, 12), 6), "model": (await c.models())["data"][0]["id"]}
            first = ids_of((await c.completions(body))["choices"][0])
            awake = rss_bytes(pid)
            await c.sleep(1)
            assert await c.is_sleeping()
            level1 = rss_bytes(pid)
            assert awake - level1 > 0.6 * kv, (awake, level1, kv)
            # a request sent while asleep waits for the wake, then is answered
            waiting = asyncio.ensure_future(c.completions(body))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            await c.wake_up()
            assert not await c.is_sleeping()
            assert ids_of((await waiting)["choices"][0]) == first
            awake = rss_bytes(pid)
            await c.sleep(2)
            level2 = rss_bytes(pid)
            assert awake - level2 > 0.6 * (kv + weights), (awake, level2, kv, weights)
            await c.wake_up()
            assert not await c.is_sleeping()
            assert ids_of((await c.completions(body))["choices"][0]) == first

    arun(main())


# -- 8. pause modes ------------------------------------------------------------------------


def test_pause_keep_freezes_and_resume_continues(E: Engines) -> None:
    async def main() -> None:
        async with EngineClient(E.engine.url, timeout_s=TIMEOUT_S) as c:
            n, got, finish = 300, 0, None
            stream = c.stream_completions(greedy(E, _prompt(11, 10), n))

            def count(ev: JSON) -> None:
                nonlocal got, finish
                for ch in ev["choices"]:
                    got += len(ch.get("token_ids") or [])
                    finish = ch.get("finish_reason") or finish

            try:
                async for ev in stream:
                    count(ev)
                    if got >= 3:
                        break
                await c.pause("keep")
                assert await c.is_paused()
                # the tokens made before the pause landed are still on their way
                nxt = asyncio.ensure_future(stream.__anext__())
                while True:
                    done, _ = await asyncio.wait([nxt], timeout=0.3)
                    if not done:
                        break
                    count(nxt.result())
                    nxt = asyncio.ensure_future(stream.__anext__())
                frozen_at = got
                await asyncio.sleep(0.5)
                assert not nxt.done() and got == frozen_at < n and finish is None
                await c.resume()
                assert not await c.is_paused()
                count(await nxt)
                async for ev in stream:
                    count(ev)
            finally:
                await c.resume()
            assert got == n and finish == "length"

    arun(main())


def test_pause_abort_ends_in_flight_requests(E: Engines) -> None:
    async def main() -> None:
        async with EngineClient(E.engine.url, timeout_s=TIMEOUT_S) as c:
            got, finish = 0, None
            try:
                async for ev in c.stream_completions(greedy(E, _prompt(12, 10), 300)):
                    for ch in ev["choices"]:
                        got += len(ch.get("token_ids") or [])
                        finish = ch.get("finish_reason") or finish
                    if got >= 3 and not await c.is_paused():
                        await c.pause("abort")
                assert finish == "abort" and 0 < got < 300
                assert await c.is_paused()
            finally:
                await c.resume()
            out = await c.completions(greedy(E, _prompt(12, 10), 3))
            assert len(ids_of(out["choices"][0])) == 3

    arun(main())


def test_pause_wait_returns_after_in_flight_requests_finish(E: Engines) -> None:
    async def main() -> None:
        async with EngineClient(E.engine.url, timeout_s=TIMEOUT_S) as c:
            first = asyncio.Event()
            done: list[JSON] = []

            async def run() -> None:
                events = []
                async for ev in c.stream_completions(greedy(E, _prompt(13, 10), 150)):
                    events.append(ev)
                    first.set()
                done.append({"finish": _finish(events)})

            task = asyncio.ensure_future(run())
            await first.wait()
            try:
                await c.pause("wait")
                await asyncio.sleep(0.05)  # the last event's delivery
                assert done == [{"finish": "length"}]
                assert await c.is_paused()
            finally:
                await c.resume()
            await task

    arun(main())


# -- 9. weights ----------------------------------------------------------------------------


def test_reload_and_push_change_outputs_and_versions(
    E: Engines, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if E.model_dir is None:
        pytest.skip("the engine's model directory is not known here")
    from pearl.engines.reference.weights import read_weights, weights_bytes

    other = _same_shape_model(E, tmp_path_factory.mktemp("models") / "other", seed=1, std=STD)
    model_dir = E.model_dir

    async def main() -> None:
        async with EngineClient(E.engine.url, timeout_s=TIMEOUT_S) as c:
            body = greedy(E, _prompt(14, 12), 12)
            base = (await c.completions(body))["choices"][0]
            res = await c.reload_weights(weights_path=str(other))
            try:
                v = res["results"][0]["weight_version"]
                new = (await c.completions(body))["choices"][0]
                assert ids_of(new) != ids_of(base)
                if E.reference:
                    assert new["weight_versions"] == [v] * 12

                if E.reference:  # the push with the tensors in the body
                    await c.start_weight_update()
                    await c.update_weights(data=weights_bytes(read_weights(model_dir)))
                    await c.finish_weight_update(7)
                    pushed = (await c.completions(body))["choices"][0]
                    assert ids_of(pushed) == ids_of(base)
                    assert pushed["weight_versions"] == [7] * 12

                    # mid-request: pause keep, new weights, resume
                    versions: list[int] = []
                    stream = c.stream_completions(greedy(E, _prompt(15, 10), 60))
                    async for ev in stream:
                        for ch in ev["choices"]:
                            versions += ch.get("weight_versions") or []
                        if len(versions) >= 3 and 8 not in versions and not await c.is_paused():
                            await c.pause("keep")
                            out = await c.reload_weights(weights_path=str(other), weight_version=8)
                            assert out["results"][0]["weight_version"] == 8
                            await c.resume()
                    assert len(versions) == 60
                    assert versions[0] == 7 and versions[-1] == 8
                    assert versions == sorted(versions)
            finally:
                await c.resume()
                await c.reload_weights(weights_path=str(model_dir))
            restored = (await c.completions(body))["choices"][0]
            assert ids_of(restored) == ids_of(base)

    arun(main())


# -- 10. metrics ---------------------------------------------------------------------------

METRIC_SAMPLES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
]
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:e2e_request_latency_seconds",
]


def test_metrics_parse_with_vllm_names_and_count_tokens(E: Engines) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async def main() -> None:
        async with EngineClient(E.engine.url, timeout_s=TIMEOUT_S) as c:
            await c.completions(greedy(E, _prompt(16, 8), 2))  # every histogram has a sample
            text = await c.metrics_text()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            samples = {s.name for f in families.values() for s in f.samples}
            for name in METRIC_SAMPLES:
                assert name in samples, name
            for name in HISTOGRAMS:
                assert families[name].type == "histogram", name
                assert f"{name}_bucket" in samples and f"{name}_count" in samples

            before = await _counter(c, "vllm:generation_tokens_total")
            await c.completions(greedy(E, _prompt(17, 8), 9))

            async def counted() -> bool:
                return await _counter(c, "vllm:generation_tokens_total") >= before + 9

            await _poll(counted)
            assert await _counter(c, "vllm:generation_tokens_total") == before + 9

    arun(main())


# -- 11. preemption ------------------------------------------------------------------------


def test_preemption_by_recompute_keeps_greedy_results(E: Engines) -> None:
    if E.small_kv is None:
        pytest.skip("needs an instance with a tiny KV cache (reference engine here)")
    small = E.small_kv

    async def main() -> None:
        async with EngineClient(small.url, timeout_s=TIMEOUT_S) as c:
            bodies = [greedy(E, _prompt(20 + i, 20), 80) for i in range(4)]
            alone = [ids_of((await c.completions(b))["choices"][0]) for b in bodies]
            before = await _counter(c, "vllm:num_preemptions_total")
            outs = await asyncio.gather(*(c.completions(b) for b in bodies))
            together = [ids_of(o["choices"][0]) for o in outs]
            assert await _counter(c, "vllm:num_preemptions_total") > before
            assert all(len(t) == 80 for t in together)
            assert together == alone

    arun(main())


# -- 12. bad requests ------------------------------------------------------------------------


def _error_400(r: httpx.Response) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"]


def test_bad_requests_get_400_and_the_server_goes_on(E: Engines) -> None:
    url = E.engine.url

    def post(path: str, **kw: Any) -> httpx.Response:
        return httpx.post(f"{url}{path}", timeout=TIMEOUT_S, **kw)

    ok = greedy(E, _prompt(30, 5), 2)
    _error_400(post("/v1/completions", json={**ok, "prompt": [1, E.vocab + 5]}))
    _error_400(post("/v1/completions", json={**ok, "prompt": [5] * (E.max_model_len + 1)}))
    _error_400(post("/v1/completions", json={**ok, "max_tokens": -1}))
    _error_400(
        post(
            "/v1/completions",
            content=b'{"prompt": [1, 2',
            headers={"Content-Type": "application/json"},
        )
    )
    _error_400(post("/v1/completions", json={**ok, "n": 2}))
    if E.reference:
        assert E.peer.kv_port is not None
        kv = {
            "do_remote_prefill": True,
            "remote_engine_id": "nobody",
            "remote_request_id": "nothing",
            "remote_block_ids": [0],
            "remote_host": "127.0.0.1",
            "remote_port": E.peer.kv_port,
        }
        _error_400(post("/v1/completions", json={**ok, "kv_transfer_params": kv}))
        _error_400(post("/collective_rpc", json={"method": "no_such_method"}))
        import torch

        from pearl.engines.reference.weights import weights_bytes

        assert post("/start_weight_update", json={}).status_code == 200
        _error_400(
            post(
                "/update_weights",
                content=weights_bytes({"no.such.weight": torch.zeros(2)}),
                headers={"Content-Type": "application/octet-stream"},
            )
        )
    _error_400(post("/pause", params={"mode": "bogus"}))
    good = post("/v1/completions", json=ok)
    assert good.status_code == 200 and len(good.json()["choices"][0]["token_ids"]) == 2
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == E.model
    assert httpx.get(f"{url}/version", timeout=10).json()["version"]
