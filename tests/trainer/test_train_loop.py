"""The trainer's loop over a real spool directory (batch files written by
``Spool.write``, as the rollout manager writes them): a trainer process SIGKILLed after it
trained a batch but before the checkpoint resumes from the last checkpoint, asks for that
batch again and trains it once (its final weights are bit-equal to an uninterrupted
run's); in process, each step is committed, published (weights exported, old versions
pruned) and announced; the manager adapter announces a version once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from rollouts import batch_of, make_batch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from pearl.agents.batches import RolloutBatch, Spool  # noqa: E402
from pearl.trainer.checkpoint import CheckpointDir  # noqa: E402
from pearl.trainer.loop import ManagerSource, SpoolSource, StepOutcome, train  # noqa: E402
from pearl.trainer.model import PolicyModel  # noqa: E402
from pearl.trainer.publish import WeightPublisher  # noqa: E402
from pearl.trainer.reference import ReferenceTrainer  # noqa: E402

HERE = Path(__file__).resolve().parent
GROUP = 4
STEPS = 3


def _spool(model_dir: Path, directory: Path) -> Spool:
    """Batches 0..2 in the spool, sampled by version 0; batch k is taken at version k (its
    tokens are k versions old)."""
    model = PolicyModel.from_dir(model_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (5,), generator=gen).tolist() for _ in range(2)]
    spool = Spool(directory)
    for k in range(STEPS):
        b = make_batch(
            model, k, 0, prompts=prompts, group=GROUP, new_tokens=6,
            subset=frozenset(range(3, 200)), gen=gen,
        )  # fmt: skip
        spool.write(batch_of(k, k, list(b.trajectories), GROUP))
    return spool


def _start(model_dir: Path, run_dir: Path, spool_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "loop_proc.py"), str(model_dir), str(run_dir),
         str(spool_dir), str(STEPS), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _log(run_dir: Path) -> list[tuple[int, int, int]]:
    lines = (run_dir / "trained.log").read_text().split("\n")
    return [(int(a), int(b), int(c)) for a, b, c in (ln.split() for ln in lines if ln)]


def test_a_trainer_killed_mid_step_trains_that_batch_once(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    spool = _spool(tiny_model_dir, tmp_path / "spool")
    run = tmp_path / "run"
    run.mkdir()
    first = _start(tiny_model_dir, run, spool.dir, "--hang-at", "1")
    deadline = time.monotonic() + 60
    while not (run / "hung").exists():
        if first.poll() is not None or time.monotonic() > deadline:
            first.kill()
            pytest.fail(f"the first trainer did not reach batch 1:\n{first.communicate()[0]}")
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGKILL)  # batch 1 trained in memory, not checkpointed
    first.wait()
    checkpoints = CheckpointDir(run / "checkpoints")
    assert checkpoints.steps() == [1]
    assert (spool.dir / "updated-000001").exists() and not (spool.dir / "updated-000002").exists()
    assert [(b, v) for b, v, _ in _log(run)] == [(0, 1), (1, 2)]

    second = _start(tiny_model_dir, run, spool.dir)
    out, _ = second.communicate(timeout=60)
    assert second.returncode == 0, out
    log = _log(run)
    assert [(b, v) for b, v, pid in log if pid == second.pid] == [(1, 2), (2, 3)]
    assert [b for b, _, _ in log] == [0, 1, 1, 2]  # batch 1 again, after the kill
    assert checkpoints.steps() == [2, 3]
    assert sorted(p.name for p in spool.dir.glob("updated-*")) == [
        "updated-000001", "updated-000002", "updated-000003"
    ]  # fmt: skip

    # committed once: the weights are an uninterrupted run's, bit for bit
    threads = torch.get_num_threads()
    try:
        from loop_proc import CONFIG

        whole = ReferenceTrainer(tiny_model_dir, CONFIG)
        for k in range(STEPS):
            whole.train_step(spool.read(k))
    finally:
        torch.set_num_threads(threads)
    resumed = load_file(checkpoints.path(3) / "model.safetensors")
    assert all(torch.equal(resumed[n], p.detach()) for n, p in whole.model.named_parameters())


def test_each_step_is_committed_published_and_announced(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    spool = _spool(tiny_model_dir, tmp_path / "spool")
    trainer = ReferenceTrainer(tiny_model_dir)
    checkpoints = CheckpointDir(tmp_path / "checkpoints", keep=2)
    publisher = WeightPublisher(tmp_path / "weights", lambda: {}, keep_versions=2)

    async def run(trainer: ReferenceTrainer) -> list[StepOutcome]:
        source = SpoolSource(spool.dir, timeout_s=5)
        return [o async for o in train(trainer, source, checkpoints, STEPS, publisher)]

    outcomes = asyncio.run(run(trainer))
    assert [o.metrics.version for o in outcomes] == [1, 2, 3]
    assert [o.metrics.off_policy_tokens for o in outcomes] == [0, 48, 48]
    assert [o.checkpoint.name for o in outcomes] == ["step-000001", "step-000002", "step-000003"]
    assert [o.published.version for o in outcomes if o.published] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000002", "v000003"]
    assert checkpoints.steps() == [2, 3]
    # a finished run asked again trains nothing, but publishes and announces its version
    again = ReferenceTrainer(tiny_model_dir)
    (spool.dir / "updated-000003").unlink()
    assert asyncio.run(run(again)) == [] and again.version == 3
    assert (spool.dir / "updated-000003").exists()


def test_the_manager_source_announces_a_version_once() -> None:
    """A stand-in for ``RolloutManager`` (its ``next_batch``, ``updated`` and
    ``ledger.version``, nothing else): the adapter skips a version the manager has."""
    calls: list[object] = []

    class Manager:
        ledger = SimpleNamespace(version=0)

        async def next_batch(self, k: int) -> RolloutBatch:
            calls.append(("batch", k))
            return RolloutBatch(k, 0, (), (), 0, 0, 0.0)

        async def updated(self, version: int) -> None:
            calls.append(("updated", version))
            self.ledger.version = version

    async def main() -> None:
        source = ManagerSource(Manager())  # type: ignore[arg-type]
        await source.batch(4)
        await source.updated(1)
        await source.updated(1)  # a resumed trainer announces its checkpoint's version again
        await source.updated(2)

    asyncio.run(main())
    assert calls == [("batch", 4), ("updated", 1), ("updated", 2)]
