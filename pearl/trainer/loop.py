"""The trainer's loop: batch ``k``, one update, the commit, the weights to the engines, the
news to the rollout.

    for k from the checkpoint's step:
        batch = await source.batch(k)           # the rollout manager's batch k
        metrics = trainer.train_step(batch)     # version v -> v + 1
        trainer.save_checkpoint(step-{k+1})     # the commit: batch k is consumed now
        await publisher.publish(trainer)        # export, every engine reloads
        await source.updated(trainer.version)   # the past-bound rule runs
        yield the step's outcome

The commit rule: batch ``k`` counts as trained once, and only once, the checkpoint
``step-{k+1}`` exists (``pearl.trainer.checkpoint``: written whole, then renamed). A
trainer killed anywhere before that resumes from ``step-{k}`` and asks for batch ``k``
again (the rollout manager hands it again from its spool: ``docs/agents.md``); killed
after it, it resumes from ``step-{k+1}``, and since the weights may not have reached the
engines nor the news the manager, it publishes them and reports ``updated`` again first
(both are idempotent: an engine reloads the same version, and the sources below skip a
version the manager has).

Two sources: the in-process rollout manager (``ManagerSource``) and the spool directory
of a manager in another process (``SpoolSource``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pearl.agents.batches import RolloutBatch, SpoolClient
from pearl.trainer.checkpoint import CheckpointDir
from pearl.trainer.protocol import Trainer, TrainMetrics
from pearl.trainer.publish import PublishResult

if TYPE_CHECKING:
    from pearl.agents.manager import RolloutManager


class BatchSource(Protocol):
    async def batch(self, k: int) -> RolloutBatch:
        """Batch ``k`` (0-based), once it is complete; again if it was taken before."""
        ...

    async def updated(self, version: int) -> None:
        """The update that made ``version`` is on the engines (idempotent)."""
        ...


class Publisher(Protocol):
    async def publish(self, trainer: Trainer) -> PublishResult: ...


class Devices(Protocol):
    """The trainer's devices, where a coordinator lends them between updates
    (``pearl.run.control.TrainerSlot``): ``update()`` holds them from the update to the
    published weights, waiting first while they are lent."""

    def update(self) -> contextlib.AbstractAsyncContextManager[None]: ...


class ManagerSource:
    """The rollout manager in this process."""

    def __init__(self, manager: RolloutManager) -> None:
        self.manager = manager

    async def batch(self, k: int) -> RolloutBatch:
        return await self.manager.next_batch(k)

    async def updated(self, version: int) -> None:
        if version > self.manager.ledger.version:
            await self.manager.updated(version)


class SpoolSource:
    """A rollout manager in another process, through its spool directory
    (``RUN_DIR/rollout/batches``)."""

    def __init__(self, directory: Path, *, timeout_s: float = 3600.0, poll_s: float = 0.05) -> None:
        self.client = SpoolClient(directory)
        self.timeout_s, self.poll_s = timeout_s, poll_s

    async def batch(self, k: int) -> RolloutBatch:
        return await self.client.batch(k, self.timeout_s, self.poll_s)

    async def updated(self, version: int) -> None:
        self.client.updated(version)  # the manager applies a version once


@dataclass(frozen=True)
class StepOutcome:
    metrics: TrainMetrics
    checkpoint: Path
    published: PublishResult | None
    batch_wait_s: float  # the wait for the batch
    checkpoint_s: float  # the commit
    elapsed_s: float  # from the batch's arrival to the end of the step (updated included)


def resume(trainer: Trainer, checkpoints: CheckpointDir) -> int:
    """Load the latest checkpoint into ``trainer``; the step to train next (0: none)."""
    latest = checkpoints.latest()
    if latest is None:
        return 0
    step, path = latest
    trainer.load_checkpoint(path)
    return step


async def train(
    trainer: Trainer,
    source: BatchSource,
    checkpoints: CheckpointDir,
    num_steps: int,
    publisher: Publisher | None = None,
    *,
    resumed: int | None = None,
    devices: Devices | None = None,
) -> AsyncIterator[StepOutcome]:
    """Train batches ``step .. num_steps - 1`` (``step`` from the latest checkpoint), one
    outcome per update; see the module docstring. ``resumed``: the caller has already
    resumed (``resume_and_publish``) at that step. With ``devices``, each update (from
    ``train_step`` to the published weights) holds them (``Devices.update``)."""
    step = (
        resumed
        if resumed is not None
        else await resume_and_publish(trainer, source, checkpoints, publisher)
    )
    for k in range(step, num_steps):
        waited = time.perf_counter()
        batch = await source.batch(k)
        arrived = time.perf_counter()
        async with devices.update() if devices is not None else contextlib.nullcontext():
            metrics = await asyncio.to_thread(trainer.train_step, batch)
            path = checkpoints.path(k + 1)
            committing = time.perf_counter()
            await asyncio.to_thread(trainer.save_checkpoint, path)
            checkpoint_s = time.perf_counter() - committing
            checkpoints.prune()
            published = await publisher.publish(trainer) if publisher is not None else None
        await source.updated(trainer.version)
        elapsed_s = time.perf_counter() - arrived
        yield StepOutcome(metrics, path, published, arrived - waited, checkpoint_s, elapsed_s)


async def resume_and_publish(
    trainer: Trainer,
    source: BatchSource,
    checkpoints: CheckpointDir,
    publisher: Publisher | None = None,
) -> int:
    """Load the latest checkpoint; after one, publish its weights and report its version
    (both idempotent); the step to train next. A run calls it before its rollout starts,
    so that no trajectory runs on older weights than the checkpoint's."""
    step, _ = await resume_published(trainer, source, checkpoints, publisher)
    return step


async def resume_published(
    trainer: Trainer,
    source: BatchSource,
    checkpoints: CheckpointDir,
    publisher: Publisher | None = None,
) -> tuple[int, PublishResult | None]:
    """``resume_and_publish``, with the publish's result (None: no checkpoint, or no
    publisher)."""
    step = await asyncio.to_thread(resume, trainer, checkpoints)
    published = None
    if step > 0:
        if publisher is not None:
            published = await publisher.publish(trainer)
        await source.updated(trainer.version)
    return step, published
