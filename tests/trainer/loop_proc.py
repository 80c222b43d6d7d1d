"""The trainer's loop as its own process, for the kill-and-resume test: a
``ReferenceTrainer`` (one thread) over a real spool directory, checkpoints in
``RUN_DIR/checkpoints``, no engines. Every ``train_step`` is recorded in
``RUN_DIR/trained.log`` (batch id, version made, pid) when it returns; with ``--hang-at K``
the process writes ``RUN_DIR/hung`` after training batch ``K`` and sleeps there, before
the checkpoint, to be SIGKILLed by the test.

    python loop_proc.py MODEL_DIR RUN_DIR SPOOL_DIR NUM_STEPS [--hang-at K]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from pearl.agents.batches import RolloutBatch
from pearl.trainer.checkpoint import CheckpointDir
from pearl.trainer.loop import SpoolSource, train
from pearl.trainer.protocol import TrainMetrics
from pearl.trainer.reference import ReferenceTrainer, TrainerConfig

CONFIG = TrainerConfig(threads=1, minibatches=2, seed=11)


class RecordingTrainer(ReferenceTrainer):
    def __init__(self, model_dir: Path, run_dir: Path, hang_at: int | None) -> None:
        super().__init__(model_dir, CONFIG)
        self.run_dir, self.hang_at = run_dir, hang_at

    def train_step(self, batch: RolloutBatch) -> TrainMetrics:
        m = super().train_step(batch)
        with (self.run_dir / "trained.log").open("a") as f:
            f.write(f"{batch.batch_id} {m.version} {os.getpid()}\n")
            f.flush()
            os.fsync(f.fileno())
        if batch.batch_id == self.hang_at:
            (self.run_dir / "hung").write_text(str(os.getpid()))
            while True:
                time.sleep(1)
        return m


async def main(args: argparse.Namespace) -> None:
    trainer = RecordingTrainer(args.model_dir, args.run_dir, args.hang_at)
    source = SpoolSource(args.spool_dir, timeout_s=30)
    checkpoints = CheckpointDir(args.run_dir / "checkpoints", keep=2)
    async for _ in train(trainer, source, checkpoints, args.num_steps):
        pass


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("model_dir", type=Path)
    p.add_argument("run_dir", type=Path)
    p.add_argument("spool_dir", type=Path)
    p.add_argument("num_steps", type=int)
    p.add_argument("--hang-at", type=int, default=None)
    asyncio.run(main(p.parse_args()))
