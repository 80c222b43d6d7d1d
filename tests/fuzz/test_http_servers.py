"""The reference engine and the router in front of it, fuzzed over real HTTP: each bad,
oversized or hostile request is a 4xx in vLLM's error body (a valid one a 2xx), never a
5xx, a traceback or a hang, and the servers go on serving: after every example a valid
request succeeds promptly and the engine is healthy (``http_fuzz`` has the property).

One engine process (``pearl engine serve`` on the tiny model) and one router front (on
a thread of this process, over that engine) for the module. The hypothesis tests take
their examples from ``fuzzing.FUZZ`` (the ``ci`` profile: 60 each, the same on every run;
``PEARL_FUZZ=long`` for many more); the plain tests below them are the hostile cases a
generator would rarely reach: a body that lies about its size or never comes, a client
that goes away mid-stream, a prompt of megabytes.
"""

from __future__ import annotations

import json
import socket
import string
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")

from engine_procs import EngineProc, running_engines
from fuzzing import FUZZ
from http_fuzz import (
    PROMPT_S,
    chat_bodies,
    check_answer,
    chunked,
    completion_bodies,
    error_of,
    json_values,
    metric,
    mutated,
    open_raw,
    post_json,
    read_answer,
    router_chat_bodies,
    router_completion_bodies,
    send,
    send_parts,
    texts,
    wait_until,
)
from http_fuzz import bounded as bounded_chat
from hypothesis import given
from hypothesis import strategies as st
from router.router_turns import Front, router_over, serving_front

from pearl.core.roles import Role
from pearl.engines.protocol import MAX_BODY_BYTES

ENGINE_ID = "engine-under-fuzz"
VALID = {
    "prompt": [11, 12, 13],
    "max_tokens": 2,
    "temperature": 0.0,
    "ignore_eos": True,
    "return_token_ids": True,
}
VALID_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG = {"prompt": [11, 12, 13], "max_tokens": 3000, "ignore_eos": True}  # runs for seconds


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProc]:
    logs = tmp_path_factory.mktemp("fuzz-engine-logs")
    with running_engines(tiny_model_dir, logs, [ENGINE_ID]) as procs:
        yield procs[0]
        assert "Traceback" not in procs[0].log_tail(), procs[0].log_tail()


@pytest.fixture(scope="module")
def front(engine: EngineProc, tiny_model_dir: Path) -> Iterator[Front]:
    from pearl.engines.reference.tokenizer import load

    with serving_front(lambda: router_over([engine], [Role.COLOCATED]), load(tiny_model_dir)) as f:
        yield f


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as c:
        yield c


def engine_serves(client: httpx.Client, url: str) -> None:
    """A valid request is answered in full, promptly, and the engine is healthy."""
    t0 = time.monotonic()
    r = client.post(f"{url}/v1/completions", json=VALID, timeout=PROMPT_S)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 2
    assert time.monotonic() - t0 < PROMPT_S
    assert client.get(f"{url}/health", timeout=PROMPT_S).status_code == 200


def running(client: httpx.Client, url: str) -> float:
    return metric(client.get(f"{url}/metrics", timeout=PROMPT_S).text, "vllm:num_requests_running")


def router_serves(client: httpx.Client, front: Front, engine: EngineProc) -> None:
    """The router's table is back to the one engine, and a turn through it succeeds."""
    table = client.get(f"{front.url}/pearl/instances", timeout=PROMPT_S).json()["instances"]
    others = [i["worker_id"] for i in table if i["worker_id"] != ENGINE_ID]
    if others:
        client.post(f"{front.url}/pearl/workers_lost", json={"worker_ids": others})
    if not any(i["worker_id"] == ENGINE_ID and i["phase"] == "ready" for i in table):
        back = {"phase": "end", "action": "abort_drain", "worker_id": ENGINE_ID, "ok": True}
        client.post(f"{front.url}/pearl/plan_steps", json=back)
    t0 = time.monotonic()
    r = client.post(f"{front.url}/v1/completions", json=VALID, timeout=PROMPT_S)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 2
    assert time.monotonic() - t0 < PROMPT_S
    engine_serves(client, engine.url)


request_ids = st.one_of(
    st.just({}),
    st.builds(
        lambda rid: {"x-request-id": rid},
        st.one_of(
            st.text(string.ascii_letters + string.digits + "-_#", max_size=16), st.just("r" * 600)
        ),
    ),
)
content_types = st.sampled_from(
    [
        "application/json",
        "application/json; charset=latin-1",
        "text/plain",
        "",
        "application/x-www-form-urlencoded",
    ]
)


# -- the engine, fuzzed -------------------------------------------------------------------


@FUZZ
@given(body=completion_bodies, headers=request_ids)
def test_engine_completions_fuzz(
    engine: EngineProc, client: httpx.Client, body: dict[str, Any], headers: dict[str, str]
) -> None:
    r = post_json(client, f"{engine.url}/v1/completions", body, headers=headers)
    if r.status_code == 200 and not body.get("stream"):
        assert r.json()["choices"], r.text
    engine_serves(client, engine.url)


@FUZZ
@given(body=chat_bodies.map(bounded_chat))
def test_engine_chat_fuzz(engine: EngineProc, client: httpx.Client, body: dict[str, Any]) -> None:
    post_json(client, f"{engine.url}/v1/chat/completions", body)
    engine_serves(client, engine.url)


ENGINE_BASES: dict[str, bytes] = {
    "/v1/completions": json.dumps(VALID).encode(),
    "/v1/chat/completions": json.dumps(VALID_CHAT).encode(),
    "/abort_requests": b'{"request_ids": ["nobody"]}',
    "/collective_rpc": b'{"method": "reload_weights", "kwargs": {"weight_version": 3}}',
    "/init_weight_transfer_engine": b'{"init_info": {"backend": "http"}}',
}
engine_mutations = st.sampled_from(sorted(ENGINE_BASES)).flatmap(
    lambda path: st.tuples(st.just(path), mutated(ENGINE_BASES[path]))
)


@FUZZ
@given(case=engine_mutations, content_type=content_types)
def test_engine_mutated_bodies(
    engine: EngineProc, client: httpx.Client, case: tuple[str, bytes], content_type: str
) -> None:
    path, body = case
    send(
        client, "POST", f"{engine.url}{path}", content=body, headers={"content-type": content_type}
    )
    engine_serves(client, engine.url)


# every route but those that stop the engine serving (pause, sleep): they are the
# control plane's, and a paused engine is one the property could not tell from a hung one
ENGINE_ROUTES = [
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/version",
    "/metrics", "/is_sleeping", "/is_paused", "/resume", "/abort_requests",
    "/reset_prefix_cache", "/collective_rpc", "/init_weight_transfer_engine",
    "/update_weights", "/finish_weight_update", "/wake_up",
]  # fmt: skip
STOPPING = ("/pause", "/sleep")
paths = st.one_of(
    st.sampled_from(ENGINE_ROUTES),
    st.builds(
        lambda route, tail: route + tail,
        st.sampled_from(ENGINE_ROUTES),
        st.sampled_from(["/", "/x", "?level=abc", "%00", "/.."]),
    ),
    st.text(string.ascii_letters + string.digits + "/._-%", min_size=1, max_size=24).map(
        lambda p: "/" + p
    ),
).filter(lambda p: not p.lstrip("/").startswith(tuple(s.lstrip("/") for s in STOPPING)))
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])


@FUZZ
@given(method=methods, path=paths, body=st.one_of(st.none(), json_values))
def test_engine_routes_and_methods(
    engine: EngineProc, client: httpx.Client, method: str, path: str, body: Any
) -> None:
    content = None if body is None else json.dumps(body, allow_nan=True).encode()
    if method == "HEAD":  # an answer without a body: its status only
        r = client.head(f"{engine.url}{path}", timeout=PROMPT_S)
        assert r.status_code < 500 and not 300 <= r.status_code < 400, r.status_code
        return engine_serves(client, engine.url)
    r = send(client, method, f"{engine.url}{path}", content=content)
    assert not 300 <= r.status_code < 400, r.headers
    if r.status_code in (404, 405):
        assert error_of(r)["code"] == r.status_code
    engine_serves(client, engine.url)


# -- the router, fuzzed -------------------------------------------------------------------

front_requests = st.one_of(
    st.tuples(st.just("/v1/completions"), router_completion_bodies),
    st.tuples(st.just("/v1/chat/completions"), router_chat_bodies.map(bounded_chat)),
    st.tuples(st.just("/v1/completions"), completion_bodies),
)
session_headers = st.one_of(
    st.just({}),
    st.builds(
        lambda sid: {"x-session-id": sid},
        st.one_of(st.text(string.ascii_letters + string.digits, max_size=12), st.just("s" * 300)),
    ),
)


@FUZZ
@given(case=front_requests, headers=session_headers)
def test_router_front_fuzz(
    front: Front,
    engine: EngineProc,
    client: httpx.Client,
    case: tuple[str, dict[str, Any]],
    headers: dict[str, str],
) -> None:
    path, body = case
    post_json(client, f"{front.url}{path}", body, headers=headers)
    router_serves(client, front, engine)


FRONT_BASES: dict[str, bytes] = {
    "/v1/completions": json.dumps(VALID).encode(),
    "/v1/chat/completions": json.dumps(VALID_CHAT).encode(),
    "/pearl/plan_steps": b'{"phase": "start", "action": "drain", "worker_id": "nobody"}',
    "/pearl/workers_lost": b'{"worker_ids": ["nobody"], "reason": "gone"}',
}
front_mutations = st.sampled_from(sorted(FRONT_BASES)).flatmap(
    lambda path: st.tuples(st.just(path), mutated(FRONT_BASES[path]))
)


@FUZZ
@given(case=front_mutations, content_type=content_types)
def test_router_mutated_bodies(
    front: Front,
    engine: EngineProc,
    client: httpx.Client,
    case: tuple[str, bytes],
    content_type: str,
) -> None:
    path, body = case
    send(client, "POST", f"{front.url}{path}", content=body, headers={"content-type": content_type})
    router_serves(client, front, engine)


plan_steps = st.fixed_dictionaries(
    {},
    optional={
        "phase": st.one_of(st.sampled_from(["start", "end", "middle"]), json_values),
        "action": st.one_of(
            st.sampled_from(
                [
                    "drain",
                    "migrate",
                    "switch",
                    "sleep",
                    "stop",
                    "start",
                    "wake",
                    "abort_drain",
                    "nope",
                ]
            ),
            json_values,
        ),
        # never the engine: a step that drains it is the control plane's to send
        "worker_id": st.one_of(
            st.sampled_from(["w1", "", "w" * 300]), texts.filter(lambda t: t != ENGINE_ID)
        ),
        "role": st.one_of(st.sampled_from(["colocated", "prefill", "decode", "boss"]), json_values),
        "url": st.one_of(
            st.sampled_from(["http://127.0.0.1:1", "ftp://x", "http://" + "h" * 3000]), json_values
        ),
        "ok": json_values,
        "extra": json_values,
    },
)


@FUZZ
@given(body=st.one_of(plan_steps, json_values))
def test_router_plan_steps_fuzz(
    front: Front, engine: EngineProc, client: httpx.Client, body: Any
) -> None:
    r = post_json(client, f"{front.url}/pearl/plan_steps", body)
    if r.status_code == 400:
        err = error_of(r)
        assert err["message"].startswith(f"{err['param']}: "), err
    router_serves(client, front, engine)


# -- hostile cases, one by one ---------------------------------------------------------------


def test_unknown_routes_and_methods_are_json_404_and_405(
    engine: EngineProc, front: Front, client: httpx.Client
) -> None:
    for url in (engine.url, front.url):
        r = client.get(f"{url}/no/such/route")
        assert r.status_code == 404 and error_of(r)["type"] == "NotFoundError"
        r = client.delete(f"{url}/v1/completions")
        assert r.status_code == 405 and error_of(r)["type"] == "MethodNotAllowedError"
        assert "POST" in r.headers["allow"]


@pytest.mark.parametrize("where", ["engine", "front"])
def test_deep_nesting_is_a_400(
    where: str, engine: EngineProc, front: Front, client: httpx.Client
) -> None:
    url = engine.url if where == "engine" else front.url
    for body in (b"[" * 100_000, b'{"prompt": ' + b"[" * 50_000 + b"1" + b"]" * 50_000 + b"}"):
        r = send(
            client,
            "POST",
            f"{url}/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and "deep" in error_of(r)["message"], r.text
    engine_serves(client, engine.url)


def test_non_finite_and_absurd_numbers_are_400s_naming_the_field(
    engine: EngineProc, client: httpx.Client
) -> None:
    cases = {
        b'{"prompt": [1], "temperature": NaN}': "temperature",
        b'{"prompt": [1], "temperature": Infinity}': "temperature",
        b'{"prompt": [1], "top_p": 1e999}': "top_p",
        b'{"prompt": [1], "seed": 18446744073709551616}': "seed",
        b'{"prompt": [1], "max_tokens": 1000000000000000000000}': "max_tokens",
        b'{"prompt": [1], "n": 1000000000}': "n",
        b'{"prompt": [1], "logprobs": 1000000000000}': "logprobs",
        b'{"prompt": [1], "min_tokens": 5, "max_tokens": 2}': "min_tokens",
        b'{"prompt": [1], "stop": ' + json.dumps(["x"] * 100_000).encode() + b"}": "stop",
        b'{"prompt": [1], "kv_transfer_params": {"do_remote_prefill": true, '
        b'"remote_engine_id": "e", "remote_request_id": "r", "remote_block_ids": [0], '
        b'"remote_host": "127.0.0.1", "remote_port": 70000}}': "kv_transfer_params.remote_port",
    }
    for body, field in cases.items():
        r = send(
            client,
            "POST",
            f"{engine.url}/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
        err = error_of(r)
        assert (r.status_code, err["param"]) == (400, field), (body[:80], err)
    engine_serves(client, engine.url)


def _hostile_kv_peer(answers: list[bytes]) -> tuple[int, threading.Event]:
    """A KV side channel on a free port that answers each pull with the next of
    ``answers`` (a head line, maybe more) and closes; the event is set when all are sent."""
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        with server:
            for answer in answers:
                conn, _ = server.accept()
                with conn:
                    conn.recv(4096)  # the pull's request line
                    conn.sendall(answer)
        done.set()

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1], done


def test_a_kv_peer_that_announces_terabytes_or_nests_json_is_a_400(
    engine: EngineProc, client: httpx.Client
) -> None:
    """The decode reads no byte of a prefill past what its prompt's KV can take (it once
    called ``readexactly`` on any announced size), and a nested head line is refused."""
    answers = [b'{"ok": true, "bytes": 1000000000000}\n', b"[" * 4000 + b"\n"]
    port, done = _hostile_kv_peer(answers)
    kv = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r",
          "remote_block_ids": [0], "remote_host": "127.0.0.1", "remote_port": port}  # fmt: skip
    problems = []
    for _ in answers:
        r = post_json(client, f"{engine.url}/v1/completions", VALID | {"kv_transfer_params": kv})
        err = error_of(r)
        assert (r.status_code, err["param"]) == (400, "kv_transfer_params"), err
        problems.append(err["message"])
    assert done.wait(PROMPT_S)
    assert "announces 1000000000000 bytes, not a prefill's" in problems[0], problems
    assert "nested more than 32 deep" in problems[1], problems
    engine_serves(client, engine.url)


def test_a_weight_version_that_is_not_an_int64_is_a_400(
    engine: EngineProc, client: httpx.Client
) -> None:
    """``true`` and ``10**30`` were taken as versions (a bool is an int in Python; an int64
    does not hold the other), by the weight push and by ``reload_weights`` alike."""
    assert client.post(f"{engine.url}/start_weight_update").status_code == 200
    for bad in (True, 10**30, -1, 1.5, "3"):
        r = post_json(client, f"{engine.url}/finish_weight_update", {"weight_version": bad})
        assert (r.status_code, error_of(r)["param"]) == (400, "weight_version"), r.text
        r = post_json(
            client,
            f"{engine.url}/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weight_version": bad}},
        )
        assert (r.status_code, error_of(r)["param"]) == (400, "kwargs"), r.text
    engine_serves(client, engine.url)


def test_a_tiny_temperature_samples_and_keeps_the_engine_healthy(
    engine: EngineProc, client: httpx.Client
) -> None:
    """logits / 1e-300 are infinite: sampled as is, the engine's step failed and every
    request in flight with it (the engine reported itself unhealthy from then on)."""
    for t in (1e-300, 5e-324, 1e-9):
        body = {"prompt": [11, 12], "max_tokens": 3, "temperature": t, "ignore_eos": True}
        r = client.post(f"{engine.url}/v1/completions", json=body, timeout=PROMPT_S)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    engine_serves(client, engine.url)


@pytest.mark.parametrize("where", ["engine", "front"])
def test_a_body_declared_over_the_limit_is_a_413_before_it_is_read(
    where: str, engine: EngineProc, front: Front, client: httpx.Client
) -> None:
    url = engine.url if where == "engine" else front.url
    headers = {"content-type": "application/json", "content-length": str(MAX_BODY_BYTES + 1)}
    sock = open_raw(url, "POST", "/v1/completions", headers)  # and not one byte of the body
    try:
        t0 = time.monotonic()
        r = read_answer(sock, timeout_s=PROMPT_S)
        assert time.monotonic() - t0 < PROMPT_S
    finally:
        sock.close()
    assert r.status_code == 413 and error_of(r)["param"] == "body", r.text
    engine_serves(client, engine.url)


@pytest.mark.parametrize("where", ["engine", "front"])
def test_a_chunked_body_past_the_limit_is_a_413(
    where: str, engine: EngineProc, front: Front, client: httpx.Client
) -> None:
    url = engine.url if where == "engine" else front.url
    sock = open_raw(
        url,
        "POST",
        "/v1/completions",
        {"content-type": "application/json", "transfer-encoding": "chunked"},
    )
    try:
        piece = b" " * 2**16
        send_parts(
            sock,
            chunked([b'{"prompt": [1], "x": "', *[piece] * (MAX_BODY_BYTES // len(piece) + 1)]),
        )
        r = read_answer(sock, timeout_s=PROMPT_S)
    finally:
        sock.close()
    assert r.status_code == 413 and error_of(r)["type"] == "RequestEntityTooLargeError", r.text
    engine_serves(client, engine.url)


@pytest.mark.parametrize("where", ["engine", "front"])
def test_a_body_that_never_comes_does_not_hold_others(
    where: str, engine: EngineProc, front: Front, client: httpx.Client
) -> None:
    url = engine.url if where == "engine" else front.url
    slow = [
        open_raw(url, "POST", path, {"content-type": ctype, "content-length": "1000"})
        for path, ctype in [
            ("/v1/completions", "application/json"),
            ("/v1/chat/completions", "application/json"),
            ("/abort_requests", "application/json"),
            ("/update_weights", "application/octet-stream"),
            ("/pearl/plan_steps", "application/json"),
        ]
    ]
    try:
        for s in slow:
            send_parts(s, [b'{"prompt": [1, 2'])  # ... and the rest never comes
        engine_serves(client, engine.url)
        router_serves(client, front, engine)
    finally:
        for s in slow:
            s.close()
    engine_serves(client, engine.url)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_gone_mid_stream_has_its_request_aborted(
    path: str, engine: EngineProc, client: httpx.Client
) -> None:
    body = {
        **(
            LONG
            if path == "/v1/completions"
            else {**VALID_CHAT, "max_tokens": 3000, "ignore_eos": True}
        )
    }
    with (
        httpx.Client() as once,
        once.stream("POST", f"{engine.url}{path}", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        chunks = r.iter_raw()  # (kept: an iterator let go closes the stream at once)
        next(chunks)
        assert running(client, engine.url) == 1
    # the connection is dropped with the stream in the middle
    wait_until(lambda: running(client, engine.url) == 0, 5.0, "the stream's request aborted")
    engine_serves(client, engine.url)


@pytest.mark.parametrize("where", ["engine", "front"])
def test_a_client_gone_before_the_answer_has_its_request_aborted(
    where: str, engine: EngineProc, front: Front, client: httpx.Client
) -> None:
    url = engine.url if where == "engine" else front.url
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=LONG, timeout=httpx.Timeout(5.0, read=0.5))
    wait_until(lambda: running(client, engine.url) == 0, 5.0, "the abandoned request aborted")
    engine_serves(client, engine.url)


def test_a_prompt_of_megabytes_is_refused_before_it_is_tokenized(
    engine: EngineProc, client: httpx.Client
) -> None:
    """No 4096-token prompt has 3 MiB of text; tokenizing them would take the engine
    seconds (a run of one character: minutes)."""
    for doc in (
        {"prompt": " " * 3 * 2**20},
        {"messages": [{"role": "user", "content": "x" * 2**21}]},
    ):
        path = "/v1/completions" if "prompt" in doc else "/v1/chat/completions"
        t0 = time.monotonic()
        r = client.post(f"{engine.url}{path}", json={**doc, "max_tokens": 1}, timeout=PROMPT_S)
        assert time.monotonic() - t0 < 2.0
        assert r.status_code == 400 and "characters cannot fit" in error_of(r)["message"], r.text
    engine_serves(client, engine.url)


def test_a_prompt_the_router_tokenizes_for_seconds_does_not_hold_others(
    engine: EngineProc, front: Front, client: httpx.Client
) -> None:
    """The router tokenizes off its event loop: other turns are routed meanwhile."""
    text = " " * 3 * 2**19  # 1.5 MiB: a few seconds of tokenizing, into 100k tokens
    answers: list[httpx.Response] = []

    def big() -> None:
        body = {"prompt": text, "max_tokens": 1}
        answers.append(httpx.post(f"{front.url}/v1/completions", json=body, timeout=60))

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.3)  # it is being tokenized now
    try:
        assert thread.is_alive(), "tokenized too fast to tell"
        router_serves(client, front, engine)
    finally:
        thread.join()
    check_answer(answers[0], 0.0)
    assert answers[0].status_code == 400  # longer than the engine's model takes


def test_router_rejects_a_session_id_too_long(
    front: Front, engine: EngineProc, client: httpx.Client
) -> None:
    r = client.post(f"{front.url}/v1/completions", json=VALID, headers={"x-session-id": "s" * 1000})
    assert r.status_code == 400 and error_of(r)["param"] == "X-Session-Id"
    router_serves(client, front, engine)
