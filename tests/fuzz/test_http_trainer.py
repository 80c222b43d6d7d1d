"""The trainer's server (``pearl trainer serve`` on the tiny model), fuzzed over real HTTP:
a mutated batch, a body that is not one, a path of the wrong type or nowhere, an unknown
route: each a 4xx in vLLM's error body (a batch that happens to be valid trains, 200),
never a 5xx or a hang, and after each one the server answers ``/state`` and takes its
lock (``/onload``) promptly. One server for the module; ``fuzzing.FUZZ`` examples."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")

from fuzzing import FUZZ
from http_fuzz import (
    EXTREME_FLOATS,
    EXTREME_INTS,
    PROMPT_S,
    VOCAB,
    error_of,
    json_values,
    mutated,
    open_raw,
    post_json,
    read_answer,
    send,
    send_parts,
)
from hypothesis import given
from hypothesis import strategies as st

from pearl.agents.batches import RolloutBatch, batch_text
from pearl.agents.loop import Trajectory
from pearl.engines.protocol import MAX_BODY_BYTES
from pearl.trainer.config import TrainerConfig
from pearl.trainer.remote import TrainerProcess
from pearl.trainer.server import MAX_BATCH_BYTES

CONFIG = TrainerConfig(minibatches=1, max_tokens_per_microbatch=64, seed=3, threads=1)


def _trajectory(i: int, reward: float) -> Trajectory:
    t = Trajectory(f"t{i}", reward=reward, end_reason="answered")
    t.append([5, 6, 7], generated=False)
    t.append([8, 9], generated=True, logprobs=[-1.0, -2.0], versions=[0, 0])
    return t


BATCH = RolloutBatch(
    batch_id=0, policy_version=0, trajectories=(_trajectory(0, 1.0), _trajectory(1, 0.0)),
    group_ids=(0, 0), off_policy_tokens=0, max_staleness_versions=0, mean_staleness_versions=0.0,
)  # fmt: skip
BATCH_TEXT = batch_text(BATCH)


@pytest.fixture(scope="module")
def trainer(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TrainerProcess]:
    proc = TrainerProcess(tiny_model_dir, CONFIG, tmp_path_factory.mktemp("fuzz-trainer")).start()
    try:
        yield proc
        assert "Traceback" not in proc.log_tail(), proc.log_tail()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as c:
        yield c


def trainer_serves(client: httpx.Client, url: str) -> None:
    """``/state`` answers, and a call that takes the trainer's lock returns, promptly."""
    t0 = time.monotonic()
    assert client.get(f"{url}/state", timeout=PROMPT_S).status_code == 200
    assert client.post(f"{url}/onload", timeout=PROMPT_S).status_code == 200
    assert time.monotonic() - t0 < PROMPT_S


FIELDS = ["token_ids", "loss_mask", "logprobs", "versions", "reward", "traj_id", "turns", "info"]
TOP = ["batch_id", "policy_version", "trajectories", "group_ids", "off_policy_tokens",
       "max_staleness_versions", "mean_staleness_versions"]  # fmt: skip
odd_values = st.one_of(
    json_values,
    st.sampled_from(EXTREME_INTS + EXTREME_FLOATS + [VOCAB, VOCAB + 1, [], [VOCAB] * 5, [-2] * 5]),
)


@st.composite
def batches(draw: st.DrawFn) -> Any:
    """The valid batch with a few of its fields (or their items) replaced or dropped."""
    doc = json.loads(BATCH_TEXT)
    for _ in range(draw(st.integers(1, 3))):
        trajs = doc.get("trajectories")
        whole = not (
            isinstance(trajs, list) and len(trajs) == 2 and all(isinstance(t, dict) for t in trajs)
        )
        if whole or draw(st.booleans()):  # (a trajectory only while there are both)
            key = draw(st.sampled_from(TOP))
            target: Any = doc
        else:
            target = trajs[draw(st.integers(0, 1))]
            key = draw(st.sampled_from(FIELDS))
        if draw(st.integers(0, 4)) == 0:
            target.pop(key, None)
        elif isinstance(target.get(key), list) and target[key] and draw(st.booleans()):
            target[key][draw(st.integers(0, len(target[key]) - 1))] = copy.deepcopy(
                draw(odd_values)
            )
        else:
            target[key] = copy.deepcopy(draw(odd_values))
    return doc


@FUZZ
@given(doc=batches())
def test_trainer_batch_fuzz(trainer: TrainerProcess, client: httpx.Client, doc: Any) -> None:
    r = post_json(client, f"{trainer.url}/train_step", doc)
    if r.status_code == 200:
        assert r.json()["state"]["version"] >= 1
    trainer_serves(client, trainer.url)


# a path a request names is nowhere that can be written (under /proc), or not a string at
# all: a generated path that happened to be valid would have a checkpoint written there
NOWHERE = ["", "\x00", "/proc/pearl-fuzz", "/proc/pearl-fuzz/missing", "x" * 5000]
paths = st.one_of(json_values.filter(lambda v: not isinstance(v, str)), st.sampled_from(NOWHERE))
path_bodies = st.one_of(
    st.fixed_dictionaries({}, optional={"path": paths, "out_dir": paths, "extra": json_values}),
    json_values.filter(lambda v: not isinstance(v, dict)),
).map(lambda d: json.dumps(d, allow_nan=True).encode())
trainer_requests = st.one_of(
    st.tuples(st.just("POST"), st.just("/train_step"), mutated(BATCH_TEXT.encode())),
    st.tuples(
        st.just("POST"),
        st.sampled_from(["/save_checkpoint", "/load_checkpoint", "/export_weights"]),
        path_bodies,
    ),
    st.tuples(
        st.sampled_from(["GET", "PUT", "DELETE", "POST"]),
        st.sampled_from(["/", "/nope", "/train_step/x", "/state", "/health"]),
        st.binary(max_size=16),
    ),
)


@FUZZ
@given(case=trainer_requests)
def test_trainer_requests_fuzz(
    trainer: TrainerProcess, client: httpx.Client, case: tuple[str, str, bytes]
) -> None:
    method, path, body = case
    headers = {"content-type": "application/json"}
    send(client, method, f"{trainer.url}{path}", content=body, headers=headers)
    trainer_serves(client, trainer.url)


def test_a_token_outside_the_vocabulary_or_an_integer_past_int64_is_a_400(
    trainer: TrainerProcess, client: httpx.Client
) -> None:
    """Torch raised IndexError on the first (a 500) and OverflowError on the second."""
    doc = json.loads(BATCH_TEXT)
    doc["trajectories"][1]["token_ids"][4] = VOCAB + 3
    r = post_json(client, f"{trainer.url}/train_step", doc)
    assert r.status_code == 400 and "trajectories[1].token_ids" in error_of(r)["message"], r.text
    doc = json.loads(BATCH_TEXT)
    doc["policy_version"] = -(2**63) - 1
    r = post_json(client, f"{trainer.url}/train_step", doc)
    assert r.status_code == 400 and "policy_version" in error_of(r)["message"], r.text
    r = post_json(client, f"{trainer.url}/export_weights", {"out_dir": "/proc/no/such/dir"})
    assert r.status_code == 400, r.text
    trainer_serves(client, trainer.url)


@pytest.mark.parametrize(
    ("path", "limit"), [("/train_step", MAX_BATCH_BYTES), ("/save_checkpoint", MAX_BODY_BYTES)]
)
def test_a_body_over_the_limit_is_a_413_and_one_that_never_comes_holds_nothing(
    path: str, limit: int, trainer: TrainerProcess, client: httpx.Client
) -> None:
    sock = open_raw(
        trainer.url,
        "POST",
        path,
        {"content-type": "application/json", "content-length": str(limit + 1)},
    )
    try:
        r = read_answer(sock, timeout_s=PROMPT_S)
    finally:
        sock.close()
    assert r.status_code == 413 and error_of(r)["param"] == "body", r.text
    slow = open_raw(
        trainer.url, "POST", path, {"content-type": "application/json", "content-length": "1000"}
    )
    try:
        send_parts(slow, [b'{"batch_id": 0, '])  # the rest never comes
        trainer_serves(client, trainer.url)
    finally:
        slow.close()
    r = client.get(f"{trainer.url}/no/such/route")
    assert r.status_code == 404 and error_of(r)["type"] == "NotFoundError"
