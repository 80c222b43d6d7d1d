"""Writes the example plan inputs of ``examples/states/`` (run: python examples/make_states.py).

Each file is a ``pearl plan`` input: a cluster state, an observation and a profile name.
They are generated, not hand-written, so they stay valid as the schema evolves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pearl.bench.synth import Layout, build_state, build_workload
from pearl.cli.plan import PlanInput
from pearl.core.observation import (
    AllocationGranted,
    AllocationPreempting,
    GrantedNode,
    Observation,
    TrainerPhase,
    TrainerStatus,
)
from pearl.core.roles import Role

OUT = Path(__file__).resolve().parent / "states"


def _write(out: Path, name: str, doc: PlanInput) -> None:
    data: dict[str, Any] = json.loads(doc.model_dump_json())
    data = {"profile": doc.profile, "now_s": doc.now_s, **data}
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")


def main(out: Path = OUT) -> None:
    rng = np.random.default_rng(7)
    out.mkdir(parents=True, exist_ok=True)
    small = build_state(Layout(1, 2, 0), time_s=100.0)
    busy = TrainerStatus(phase=TrainerPhase.TRAINING)
    waiting = TrainerStatus(phase=TrainerPhase.WAITING)
    _write(
        out,
        "small-homogeneous",
        PlanInput(
            profile="qwen3-8b",
            now_s=100.0,
            state=small,
            observation=Observation(trainer=busy, workload=build_workload(rng, 48)),
        ),
    )
    _write(
        out,
        "waiting-trainer",
        PlanInput(
            profile="qwen3-8b",
            now_s=100.0,
            state=small,
            observation=Observation(
                trainer=waiting,
                workload=build_workload(
                    rng, 512, mean_turns=4, prompt_tokens=6000, not_started=1536
                ),
            ),
        ),
    )
    grant = AllocationGranted(
        allocation_id="7001",
        end_by_s=3700.0,
        nodes=(GrantedNode(node="gpu-e01", gpu_type="h100", num_gpus=8),),
    )
    _write(
        out,
        "elastic-grant",
        PlanInput(
            profile="qwen3-8b",
            now_s=100.0,
            state=small,
            observation=Observation(
                events=(grant,),
                trainer=busy,
                workload=build_workload(rng, 512, prompt_tokens=6000, not_started=1536),
            ),
        ),
    )
    with_elastic = build_state(Layout(1, 2, 1), time_s=200.0)
    preempt = AllocationPreempting(allocation_id="el0000", deadline_s=260.0)
    _write(
        out,
        "elastic-preempted",
        PlanInput(
            profile="qwen3-8b",
            now_s=200.0,
            state=with_elastic,
            observation=Observation(
                events=(preempt,), trainer=busy, workload=build_workload(rng, 64)
            ),
        ),
    )
    hetero = build_state(
        Layout(1, 2, 2, gpu_type="h800", elastic_gpu_type="h20", rollout_tp=2), time_s=50.0
    )
    _write(
        out,
        "heterogeneous",
        PlanInput(
            profile="qwen3-30b-a3b",
            now_s=50.0,
            state=hetero,
            observation=Observation(trainer=busy, workload=build_workload(rng, 128)),
        ),
    )
    large = build_state(Layout(16, 32, 16, rollout_tp=2, rollout_role=Role.COLOCATED), time_s=10.0)
    _write(
        out,
        "large",
        PlanInput(
            profile="qwen3-8b",
            now_s=10.0,
            state=large,
            observation=Observation(trainer=waiting, workload=build_workload(rng, 256)),
        ),
    )


if __name__ == "__main__":
    main()
