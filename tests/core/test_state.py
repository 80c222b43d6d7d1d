from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from pearl.bench.synth import Layout, build_state
from pearl.core.roles import Phase, Role
from pearl.core.state import ClusterState


def _doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(build_state(Layout(1, 1, 1)).model_dump_json())
    return doc


def test_json_round_trip_is_exact() -> None:
    state = build_state(Layout(2, 3, 1, rollout_tp=2))
    again = ClusterState.model_validate_json(state.model_dump_json())
    assert again == state
    assert again.model_dump_json() == state.model_dump_json()


def test_snapshots_are_immutable_and_versioned() -> None:
    state = build_state(Layout(1, 1, 1))
    with pytest.raises(ValidationError):
        state.version = 5  # type: ignore[misc]
    nxt = state.replace(time_s=10.0)
    assert (nxt.version, nxt.time_s, state.version) == (state.version + 1, 10.0, state.version)


def _problem(doc: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as err:
        ClusterState.model_validate(doc)
    e = err.value.errors()[0]
    return ".".join(map(str, e["loc"])) + " | " + e["msg"]


def test_unknown_role_names_the_field() -> None:
    doc = _doc()
    doc["workers"][0]["role"] = "juggler"
    assert _problem(doc).startswith("workers.0.role | Input should be")


def test_negative_count_names_the_field() -> None:
    doc = _doc()
    doc["allocations"][0]["num_gpus"] = -1
    assert _problem(doc).startswith("allocations.0.num_gpus | Input should be greater")


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        pytest.param(
            lambda d: d["workers"][0].update(gpu_ids=["nope/0"]),
            "workers[0].gpu_ids: unknown GPU 'nope/0'",
            id="unknown-gpu",
        ),
        pytest.param(
            lambda d: d["gpus"][0].update(allocation_id="x"),
            "gpus[0].allocation_id: unknown allocation 'x'",
            id="unknown-allocation",
        ),
        pytest.param(
            lambda d: d["gpus"][-1].update(lent=True),
            "gpus[23].lent: only base-train GPUs can be lent",
            id="lent-elastic",
        ),
        pytest.param(
            lambda d: d["workers"][1].update(role="decode"),
            "engine active on base-train GPU 'train0000/0' not lent",
            id="unlent-engine",
        ),
        pytest.param(
            lambda d: d["workers"].append({**d["workers"][-1], "worker_id": "dup"}),
            "already hosts active",
            id="two-active-on-one-gpu",
        ),
        pytest.param(
            lambda d: d["workers"][-1].update(node="train0000"),
            "is on elas0000, not train0000",
            id="wrong-node",
        ),
        pytest.param(
            lambda d: d["workers"].append(d["workers"][0]),
            "workers: duplicate id 't-train0000'",
            id="duplicate-worker",
        ),
    ],
)
def test_cross_reference_problems(mutate: Any, expected: str) -> None:
    doc = _doc()
    mutate(doc)
    assert expected in _problem(doc)


def test_a_lent_gpu_may_host_an_engine_and_not_the_trainer() -> None:
    doc = _doc()
    for g in doc["gpus"][:8]:
        g["lent"] = True
    doc["workers"][0].update(role="idle")
    doc["workers"][1].update(role="decode")
    state = ClusterState.model_validate(doc)
    assert state.worker_by_id["e-train0000-0"].active
    doc["workers"][0].update(role="train")
    assert "trainer active on lent GPU" in _problem(doc)


def test_indexes_and_views() -> None:
    state = build_state(Layout(1, 2, 1))
    assert len(state.gpu_by_id) == 32
    assert state.worker_by_id["t-train0000"].role is Role.TRAIN
    active = state.active_worker_on()
    assert active["train0000/3"].worker_id == "t-train0000"
    assert all(w.phase is Phase.READY for w in state.live_workers())


def test_evolve_moves_the_clock_without_revalidating_and_refuses_checked_fields() -> None:
    state = build_state(Layout(1, 1, 1))
    later = state.evolve(time_s=50.0, last_pd_switch_s=40.0)
    assert (later.version, later.time_s, later.gpus) == (state.version + 1, 50.0, state.gpus)
    with pytest.raises(ValueError, match="use replace"):
        state.evolve(workers=())
