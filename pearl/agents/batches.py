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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

from pearl.agents.loop import Trajectory
from pearl.io.atomic import write_text_atomic

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
        if len(self.group_ids) != len(self.trajectories):
            raise ValueError("group_ids: one per trajectory")
        for t in self.trajectories:
            problem = length_problem(t)
            if problem is not None:
                raise ValueError(problem)

    @property
    def groups(self) -> dict[int, list[Trajectory]]:
        out: dict[int, list[Trajectory]] = {}
        for g, t in zip(self.group_ids, self.trajectories, strict=True):
            out.setdefault(g, []).append(t)
        return out


def length_problem(t: Trajectory) -> str | None:
    """Why a trajectory's per-token lists cannot be trained on, if they cannot."""
    n = len(t.token_ids)
    if len(t.loss_mask) == len(t.logprobs) == len(t.versions) == n:
        return None
    return (
        f"trajectory {t.traj_id}: token_ids, loss_mask, logprobs and versions differ in "
        f"length ({n}, {len(t.loss_mask)}, {len(t.logprobs)}, {len(t.versions)})"
    )


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


def first_error(err: ValidationError) -> str:
    """``field 'a.b': message`` of a validation's first error."""
    e = err.errors()[0]
    field = ".".join(str(p) for p in e["loc"]) or "(document)"
    return f"field '{field}': {e['msg']}"


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
        path = self.dir / BATCH_FILE.format(batch_id)
        return batch_of(path.read_text(encoding="utf-8"), str(path))

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
        return batch_of(path.read_text(encoding="utf-8"), str(path))

    def updated(self, version: int) -> None:
        self._touch(UPDATED_FILE.format(version))
