"""What the rollout manager hands the trainer, and the queue it goes through.

A :class:`RolloutBatch` is what the ledger's ``take_batch`` chose — whole GRPO groups, every
trajectory finished — with each trajectory's tokens, loss mask, logprobs, versions and
reward (``pearl.agents.loop.Trajectory``), in group order.

The queue (``docs/agents.md``, "The batch queue"):

- **in-process** (the local run): ``await manager.next_batch()`` waits until the next
  batch is complete, takes it, and returns it; ``await manager.updated(version)`` after
  the update's weights are on the engines;
- **across processes**: a spool directory (``RUN_DIR/rollout/batches``) of files, the
  same two calls as requests: the trainer writes ``want-NNNNNN`` (the batch it waits for),
  the manager takes that batch and writes ``batch-NNNNNN.json``; the trainer writes
  ``updated-NNNNNN`` (the version its update made) and the manager applies it. Every file
  is written whole (a temporary name, then a rename) and stays: the spool is also the
  record of what was handed over. :class:`SpoolClient` is the trainer's side.

Every batch the manager takes is written to the spool, in-process runs included, before
the take is journaled: a manager that dies between the two takes the same batch again
when it resumes (the journal replays to the same books) and writes the same file.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

from pearl.agents.loop import NOT_GENERATED, Trajectory
from pearl.core.limits import MAX_TOKENS, MAX_TRAJECTORIES
from pearl.io.atomic import write_text_atomic
from pearl.io.documents import InputError

BATCH_FILE = "batch-{:06d}.json"
WANT_FILE = "want-{:06d}"
UPDATED_FILE = "updated-{:06d}"
_REQUEST = re.compile(r"^(want|updated)-(\d{6})$")


@dataclass(frozen=True)
class RolloutBatch:
    batch_id: int
    policy_version: int  # the weights the update trains (staleness counts from here)
    trajectories: tuple[Trajectory, ...]  # whole groups, in order
    group_ids: tuple[int, ...]  # the group of each trajectory
    off_policy_tokens: int
    max_staleness_versions: int
    mean_staleness_versions: float

    # a logprob of -inf (or a reward of NaN) is written as JSON's -Infinity, and read back
    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(ser_json_inf_nan="constants")

    def __post_init__(self) -> None:
        problem = batch_problem(self)
        if problem is not None:
            raise ValueError(f"{problem[0]}: {problem[1]}")

    @property
    def groups(self) -> dict[int, list[Trajectory]]:
        out: dict[int, list[Trajectory]] = {}
        for g, t in zip(self.group_ids, self.trajectories, strict=True):
            out.setdefault(g, []).append(t)
        return out


MAX_VERSION = 2**62  # a policy version, a batch id (far past any run's updates)
LOGPROB_SLACK = 1e-3  # a logprob above 0 by more than rounding is no probability's


def batch_problem(batch: RolloutBatch) -> tuple[str, str] | None:
    """The first field of ``batch`` that cannot be trained on, and why (None if none):
    counts in range, one group per trajectory, and each trajectory's
    :func:`trajectory_problem`. A reward or a logprob that is not finite passes: the
    trainer masks it (``pearl.trainer.batching``)."""
    if len(batch.trajectories) > MAX_TRAJECTORIES:
        return "trajectories", f"{len(batch.trajectories)}: more than {MAX_TRAJECTORIES}"
    if len(batch.group_ids) != len(batch.trajectories):
        n, m = len(batch.group_ids), len(batch.trajectories)
        return "group_ids", f"one per trajectory ({n} for {m})"
    counts = {
        "batch_id": batch.batch_id,
        "policy_version": batch.policy_version,
        "off_policy_tokens": batch.off_policy_tokens,
        "max_staleness_versions": batch.max_staleness_versions,
    }
    for name, value in counts.items():
        if not 0 <= value <= MAX_VERSION:
            return name, f"{value} is not a count from 0 to {MAX_VERSION}"
    if not 0.0 <= batch.mean_staleness_versions <= MAX_VERSION:  # NaN fails too
        return "mean_staleness_versions", f"{batch.mean_staleness_versions} is not from 0"
    bad_group = next((g for g in batch.group_ids if not 0 <= g <= MAX_VERSION), None)
    if bad_group is not None:
        return "group_ids", f"{bad_group} is not a group id from 0 to {MAX_VERSION}"
    for i, t in enumerate(batch.trajectories):
        problem = trajectory_problem(t)
        if problem is not None:
            return f"trajectories[{i}].{problem[0]}", f"trajectory {t.traj_id}: {problem[1]}"
    return None


def trajectory_problem(t: Trajectory) -> tuple[str, str] | None:
    """The first per-token list of ``t`` that cannot be trained on, and why: the four
    lists of one length (at most ``MAX_TOKENS``), token ids not negative, a loss mask of 0s
    and 1s, versions from ``NOT_GENERATED`` (-1) up, no logprob above 0."""
    n = len(t.token_ids)
    if not len(t.loss_mask) == len(t.logprobs) == len(t.versions) == n:
        return "token_ids", (
            f"token_ids, loss_mask, logprobs and versions differ in length "
            f"({n}, {len(t.loss_mask)}, {len(t.logprobs)}, {len(t.versions)})"
        )
    if n > MAX_TOKENS:
        return "token_ids", f"{n} tokens: more than {MAX_TOKENS}"
    checks: list[tuple[str, list[Any], Callable[[Any], bool], str]] = [
        ("token_ids", t.token_ids, lambda x: 0 <= x <= MAX_VERSION, "is not a token id"),
        ("loss_mask", t.loss_mask, lambda x: x in (0, 1), "is not 0 or 1"),
        ("versions", t.versions, lambda x: NOT_GENERATED <= x <= MAX_VERSION, "is not a version"),
        ("logprobs", t.logprobs, lambda x: not x > LOGPROB_SLACK, "is above 0: not a logprob"),
    ]
    for name, values, ok, problem in checks:
        at = next((k for k, x in enumerate(values) if not ok(x)), None)
        if at is not None:
            return f"{name}[{at}]", f"{values[at]!r} {problem}"
    return None


def vocabulary_problem(batch: RolloutBatch, vocab_size: int) -> tuple[str, str] | None:
    """The first token id of ``batch`` outside a vocabulary of ``vocab_size`` (the model's
    embedding raises IndexError on it), as a field and a problem; None if none."""
    for i, t in enumerate(batch.trajectories):
        at = next((k for k, x in enumerate(t.token_ids) if x >= vocab_size), None)
        if at is not None:
            return (
                f"trajectories[{i}].token_ids[{at}]",
                f"{t.token_ids[at]} is out of the vocabulary (size {vocab_size})",
            )
    return None


_BATCH = TypeAdapter(RolloutBatch)
_TRAJECTORY = TypeAdapter(Trajectory)


def trajectory_doc(traj: Trajectory) -> dict[str, Any]:
    return _TRAJECTORY.dump_python(traj, mode="json")  # type: ignore[no-any-return]


def trajectory_of(doc: object, where: str) -> Trajectory:
    try:
        return _TRAJECTORY.validate_python(doc)
    except ValidationError as err:
        raise ValueError(f"{where}: {first_error(err)}") from None


def batch_text(batch: RolloutBatch) -> str:
    return _BATCH.dump_json(batch).decode() + "\n"


def batch_of(text: str, where: str) -> RolloutBatch:
    try:
        return _BATCH.validate_json(text)
    except ValidationError as err:
        raise ValueError(f"{where}: {first_error(err)}") from None


def read_batch(path: Path) -> RolloutBatch:
    """The batch file at ``path``; an ``InputError`` naming it, and the field, if it is
    missing, unreadable or not a batch that can be trained on."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(path, "", "no such batch file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(path, "", f"cannot read: {type(err).__name__}") from None
    try:
        return _BATCH.validate_json(text)
    except ValidationError as err:
        e = err.errors()[0]
        if not e["loc"] and e["type"] == "value_error":  # batch_problem's, its field named
            field, _, problem = str(e["ctx"]["error"]).partition(": ")
            raise InputError(path, field, problem) from None
        field = ".".join(str(p) for p in e["loc"])
        raise InputError(path, field, e["msg"]) from None


def first_error(err: ValidationError) -> str:
    """``field 'a.b': message`` of a validation's first error (a batch's own check,
    :func:`batch_problem`, names its field itself)."""
    e = err.errors()[0]
    field = ".".join(str(p) for p in e["loc"])
    if not field and e["type"] == "value_error":
        return str(e["ctx"]["error"])
    return f"field '{field or '(document)'}': {e['msg']}"


class Spool:
    """The manager's side of the spool directory."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def write(self, batch: RolloutBatch) -> Path:
        path = self.dir / BATCH_FILE.format(batch.batch_id)
        write_text_atomic(path, batch_text(batch))
        return path

    def read(self, batch_id: int) -> RolloutBatch:
        return read_batch(self.dir / BATCH_FILE.format(batch_id))

    def requests(self) -> tuple[set[int], list[int]]:
        """The batch ids of ``want-`` files, and the versions of ``updated-`` files in
        order."""
        wants: set[int] = set()
        updates: list[int] = []
        for p in self.dir.iterdir():
            m = _REQUEST.match(p.name)
            if m is None:
                continue
            if m.group(1) == "want":
                wants.add(int(m.group(2)))
            else:
                updates.append(int(m.group(2)))
        return wants, sorted(updates)


class SpoolClient:
    """The trainer's side, in another process: ask for batches, report updates."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def _touch(self, name: str) -> None:
        write_text_atomic(self.dir / name, "")

    async def batch(self, batch_id: int, timeout_s: float, poll_s: float = 0.05) -> RolloutBatch:
        path = self.dir / BATCH_FILE.format(batch_id)
        if not path.exists():
            self._touch(WANT_FILE.format(batch_id))
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: no batch {batch_id} after {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)
        return read_batch(path)

    def updated(self, version: int) -> None:
        self._touch(UPDATED_FILE.format(version))
