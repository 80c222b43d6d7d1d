"""What a batch must be to be trained on (``pearl.agents.batches.batch_problem``), checked
wherever one is built or read: a batch file in the spool (one ``InputError`` naming the
file and the field), the trainer's request body (a ``ValueError`` naming the field: the
server's 400), a trajectory the manager finishes (``agent_error``). A reward or a logprob
that is not finite passes: the trainer masks it."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pearl.agents.batches import RolloutBatch, batch_of, batch_text, read_batch
from pearl.agents.loop import Trajectory
from pearl.agents.manager import _checked
from pearl.io.documents import InputError


def _trajectory(i: int, reward: float = 1.0, logprob: float = -1.0) -> Trajectory:
    t = Trajectory(f"t{i}", reward=reward, end_reason="answered")
    t.append([5, 6, 7], generated=False)
    t.append([8, 9], generated=True, logprobs=[logprob, -2.0], versions=[0, 0])
    return t


def _batch(*trajs: Trajectory) -> RolloutBatch:
    trajs = trajs or (_trajectory(0), _trajectory(1, 0.0))
    return RolloutBatch(
        batch_id=0, policy_version=0, trajectories=trajs, group_ids=(0,) * len(trajs),
        off_policy_tokens=0, max_staleness_versions=0, mean_staleness_versions=0.0,
    )  # fmt: skip


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit of the batch document: ``value`` at ``path`` (``a.1.b``)."""

    def edit(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = doc
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        target[int(last) if last.isdigit() else last] = value

    return edit


IMPOSSIBLE = [
    ("trajectories.1.loss_mask.4", 5, "trajectories[1].loss_mask[4]", "5 is not 0 or 1"),
    ("trajectories.0.logprobs.3", 0.7, "trajectories[0].logprobs[3]", "above 0: not a logprob"),
    ("trajectories.1.token_ids.0", -3, "trajectories[1].token_ids[0]", "not a token id"),
    ("trajectories.0.versions.4", -7, "trajectories[0].versions[4]", "not a version"),
    ("trajectories.0.versions", [0], "trajectories[0].token_ids", "differ in length"),
    ("group_ids", [0], "group_ids", "one per trajectory (1 for 2)"),
    ("group_ids", [0, -1], "group_ids", "-1 is not a group id"),
    ("policy_version", -1, "policy_version", "-1 is not a count"),
    ("batch_id", 2**63, "batch_id", "is not a count"),
    ("mean_staleness_versions", -0.5, "mean_staleness_versions", "is not from 0"),
]


@pytest.mark.parametrize(("at", "value", "field", "problem"), IMPOSSIBLE)
def test_a_batch_that_cannot_be_trained_on_is_refused_naming_its_field(
    at: str, value: Any, field: str, problem: str, tmp_path: Path
) -> None:
    doc = json.loads(batch_text(_batch()))
    _set(at, value)(doc)
    text = json.dumps(doc)
    path = tmp_path / "batch-000000.json"
    path.write_text(text)
    with pytest.raises(InputError) as read:
        read_batch(path)
    assert str(read.value).startswith(f"{path}: {field}: "), read.value
    assert problem in str(read.value)
    with pytest.raises(ValueError) as body:
        batch_of(text, "request body")
    assert str(body.value).startswith(f"request body: {field}: "), body.value


def test_a_missing_or_torn_batch_file_is_one_line_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "batch-000003.json"
    with pytest.raises(InputError, match="no such batch file"):
        read_batch(path)
    path.write_text(batch_text(_batch())[:100])
    with pytest.raises(InputError) as err:
        read_batch(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_a_nan_reward_and_an_infinite_logprob_pass_to_be_masked(tmp_path: Path) -> None:
    batch = _batch(_trajectory(0, reward=math.nan, logprob=-math.inf), _trajectory(1))
    path = tmp_path / "batch-000000.json"
    path.write_text(batch_text(batch))
    back = read_batch(path)
    assert math.isnan(back.trajectories[0].reward)
    assert back.trajectories[0].logprobs[3] == -math.inf


def test_a_trajectory_an_engine_answered_impossibly_ends_as_an_agent_error() -> None:
    """The manager keeps the group whole: the trajectory ends with no tokens, as one whose
    lists differ in length does; the trainer masks it out."""
    checked, doc = _checked(_trajectory(0, logprob=3.5))
    assert checked.end_reason == "agent_error" and checked.token_ids == []
    assert "logprobs[3]: 3.5 is above 0" in checked.info["error"]
    assert doc["end_reason"] == "agent_error"
