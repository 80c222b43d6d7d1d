"""A rollout manager in a process of its own, for the restart test: it runs the manager of
``tests/agents/test_manager.py``'s settings on RUN_DIR against the engines at URLS and
plays the trainer (take a batch, report an update) until it is killed.

    python tests/agents/manager_proc.py MODEL_DIR RUN_DIR URL[,URL...]
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from manager_setup import open_manager


async def main(model_dir: Path, run_dir: Path, urls: list[str]) -> None:
    manager = await open_manager(model_dir, run_dir, urls)
    manager.start()
    while True:
        batch = await manager.next_batch()
        await manager.updated(batch.policy_version + 1)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")))
