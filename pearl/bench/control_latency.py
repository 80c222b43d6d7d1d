"""Benchmark of the MPI control plane: round trip of a 64-step plan over N local agents.

``bench_control(N)`` opens a :class:`~pearl.control.coordinator_side.ControlServer` in this
process (MPI singleton init, which MPICH supports as the accepting side), starts N agents
as separate ``mpiexec -n 1`` runs with :class:`~pearl.control.workers.NullWorkers` (no
engine: the figure is the control plane's own latency), and times ``execute_plan`` of a
64-step plan: per worker a drain then a dependent switch (the two-phase role change), the
workers spread round-robin over the agents' nodes, so each plan is two dependent waves of
commands and acks. Prints ``{"agents": N, "p50_ms": ..., "p99_ms": ...}`` (plus repeats).
Target (docs): p99 <= 50 ms at 16 agents on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from pearl.control.agent import agent_command
from pearl.core.pd import PDConfig
from pearl.core.plan import Action, PlanStep, Target, TransitionPlan
from pearl.core.roles import Role


def two_phase_plan(nodes: list[str], num_steps: int = 64) -> TransitionPlan:
    """``num_steps // 2`` workers, each drained then switched (colocated <-> decode)."""
    steps: list[PlanStep] = []
    for w in range(num_steps // 2):
        node = nodes[w % len(nodes)]
        gpu = (f"{node}/{w // len(nodes)}",)
        role = Role.DECODE if w % 2 else Role.PREFILL
        sid = len(steps)
        steps.append(PlanStep(sid, Action.DRAIN, f"w{w}", node, gpu, None, (), 0.1, 0.0, "bench"))
        steps.append(
            PlanStep(sid + 1, Action.SWITCH, f"w{w}", node, gpu, role, (sid,), 0.1, 0.1, "bench")
        )
    return TransitionPlan(Target(PDConfig()), tuple(steps), num_role_changes=num_steps // 2)


def bench_control(num_agents: int, repeats: int = 100, warmup: int = 5) -> dict[str, Any]:
    from pearl.control.coordinator_side import ControlServer
    from pearl.control.execute import execute_plan

    run_dir = tempfile.mkdtemp(prefix="pearl-bench-control-")
    server = ControlServer.open(run_dir, heartbeat_s=0.5, knock_host="127.0.0.1")
    procs = []
    try:
        for i in range(num_agents):
            argv = agent_command(
                run_dir, f"n{i}", "--agent-id", f"a{i}", "--gpus", "0,1", "--null-workers"
            )
            procs.append(
                subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            )
        server.wait_for_agents(num_agents, timeout_s=60 + 2 * num_agents)
        plan = two_phase_plan([f"n{i}" for i in range(num_agents)])
        times = []
        for r in range(warmup + repeats):
            res = execute_plan(server, plan)
            if not res.ok:
                bad = [s for s in res.steps.values() if s.status != "ok"][:3]
                raise RuntimeError(f"bench plan failed: {bad}")
            if r >= warmup:
                times.append(res.elapsed_s * 1e3)
        times.sort()
        return {
            "agents": num_agents,
            "p50_ms": round(times[len(times) // 2], 3),
            "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 3),
            "plan_steps": len(plan.steps),
            "repeats": repeats,
        }
    finally:
        server.close()
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pearl bench control", description=__doc__.split("\n")[0])
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.agents < 1 or args.repeats < 1:
        print("need --agents >= 1 and --repeats >= 1", file=sys.stderr)
        return 2
    result = bench_control(args.agents, args.repeats)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)
    os._exit(0)  # skip MPI_Finalize: the agents' intercommunicators are already dropped


if __name__ == "__main__":
    sys.exit(main())
