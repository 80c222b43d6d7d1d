"""The coordinator's side of the MPI control plane, as the loop uses it.

``MpiControl`` opens the port the node agents connect to (``pearl.control``), executes
plans on them (one acknowledged command per step, aborts on failure) and reports the
agents it knows, which the loop writes to ``run_dir/agents.json`` every tick.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pearl.core.plan import TransitionPlan


class MpiControl:
    def __init__(self, run_dir: Path) -> None:
        from pearl.control.coordinator_side import ControlServer  # initialises MPI

        self.server = ControlServer(run_dir)

    def execute(self, plan: TransitionPlan) -> bool:
        from pearl.control.execute import execute_plan

        return execute_plan(self.server, plan).ok

    def agents(self) -> list[dict[str, Any]]:
        return [
            {
                "agent_id": a.agent_id,
                "node": a.node,
                "gpus": [g.id for g in a.gpus],
                "job_id": a.job_id,
                "state": a.state,
            }
            for a in self.server.agents_snapshot()
        ]

    def close(self) -> None:
        self.server.close()


def write_agents(path: Path, agents: list[dict[str, Any]]) -> None:
    """Atomically replace ``path`` with the agents' list (readers never see half)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(agents) + "\n", encoding="utf-8")
    os.replace(tmp, path)
