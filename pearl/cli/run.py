"""``pearl run [CONFIG]``: agentic RL end to end on this machine (``docs/run.md``).

With no file, the embedded default (``pearl.run.config.RunConfig()``): the tiny Qwen3 on
``single_digit``. The progress display goes to stderr; with ``--json`` stdout carries one
JSON object at the end (the reward curve, the times) and nothing else. Needs the engine
extra, imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from pearl.cli.flags import integer
from pearl.io.documents import InputError, parse
from pearl.io.extras import require


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="train an agent end to end on this machine")
    p.add_argument("config", nargs="?", help="run configuration (default: the embedded one)")
    p.add_argument(
        "--steps", type=integer(1, 10_000_000), help="updates to train (overrides trainer.steps)"
    )
    p.add_argument("--run-dir", help="the run's folder (overrides run_dir)")
    p.add_argument(
        "--seed", type=integer(0, 2**63 - 1), help="overrides rollout.seed and model.seed"
    )
    p.add_argument(
        "--cluster",
        choices=("local", "slurm"),
        help="elastic devices from this machine or from Slurm (overrides cluster)",
    )
    p.add_argument(
        "--submit",
        action="store_true",
        help="with --cluster slurm: submit the run as a Slurm job (submitit) and print its id",
    )
    p.add_argument(
        "--rollout-agent",
        action="store_true",
        help="with slurm.rollout: the node agent of one node of the run's job's second "
        "component (slurm/pearl-run.sbatch starts it there)",
    )
    p.add_argument("--folder", default="runs/jobs", help="--submit: submitit's job folder")
    p.add_argument("--json", action="store_true", help="print only the summary JSON")
    p.add_argument(
        "--print-config", action="store_true", help="print the configuration as JSON and exit"
    )
    p.set_defaults(run=run)


def summary(
    rewards: list[float], wall_s: float, run_dir: Path, tokens_per_s: float
) -> dict[str, Any]:
    k = min(5, len(rewards) // 2)
    first = sum(rewards[:k]) / k if k else None
    last = sum(rewards[-k:]) / k if k else None
    return {
        "run_dir": str(run_dir),
        "steps": len(rewards),
        "wall_s": round(wall_s, 1),
        "reward_mean_per_step": [round(r, 4) for r in rewards],
        "reward_first5_mean": None if first is None else round(first, 4),
        "reward_last5_mean": None if last is None else round(last, 4),
        "rollout_tokens_per_s": round(tokens_per_s, 1),  # generated, over the wall time
    }


def run(args: argparse.Namespace) -> int:
    from pearl.run.config import RunConfig, load_run_config

    config, base = load_run_config(args.config)
    changes: dict[str, Any] = {}
    if args.run_dir is not None:  # from the working directory, as a command line reads
        changes["run_dir"] = str(Path(args.run_dir).resolve())
    if args.steps is not None:
        if args.steps < 1:
            raise InputError("<command line>", "--steps", f"at least 1, not {args.steps}")
        changes["trainer"] = config.trainer.model_copy(update={"steps": args.steps})
    if args.seed is not None:
        changes["rollout"] = config.rollout.model_copy(update={"seed": args.seed})
        changes["model"] = config.model.model_copy(update={"seed": args.seed})
    if args.cluster is not None:
        changes["cluster"] = args.cluster
    where = args.config or "<command line>"
    config = parse(RunConfig, {**config.model_dump(), **changes}, where)
    if args.cluster == "slurm":  # (a file that says so was checked as it loaded)
        from pearl.run.config import cluster_profile

        cluster_profile(config, base, Path(args.config) if args.config else None)
    if config.cluster == "slurm" and not args.print_config:
        for module in ("mpi4py", "submitit"):  # the agents' control plane, Slurm's jobs
            require(module)
    if args.rollout_agent:
        return rollout_agent(config, base)
    if args.submit:
        return submit(args, config)
    if args.print_config:
        print(config.model_dump_json(indent=2))
        return 0
    for module in ("torch", "fastapi", "uvicorn", "safetensors", "tokenizers", "rich"):
        require(module)
    if config.engines.backend == "vllm" and shutil.which("vllm") is None:
        problem = "`vllm` is not on PATH (engines.backend: vllm): pip install vllm"
        raise InputError("<environment>", "vllm", problem)
    if config.cluster == "slurm":  # the rollout nodes it names are the job's second part
        from pearl.run.rollout_nodes import check_heterogeneous

        check_heterogeneous(config)
    from pearl.agents.journal import JournalError
    from pearl.run.local import RunStateError, RunStopped
    from pearl.run.local import run as run_local

    try:
        result = run_local(config, base, show=not args.json)
    except (JournalError, RunStateError) as err:  # the run directory's books, not a bug
        raise InputError(config.run_dir, "run_dir", str(err)) from None
    except RunStopped as stopped:  # Slurm's warning before a requeue, a SIGTERM, ...
        print(f"pearl run: {stopped}; the same command resumes it", file=sys.stderr)
        return 128 + stopped.signal.value
    rewards = [s.reward_mean for s in result.steps]
    tps = result.generated_tokens / max(result.wall_s, 1e-9)
    doc = summary(rewards, result.wall_s, result.run_dir, tps)
    doc["trainer_restarts"] = result.trainer_restarts
    print(json.dumps(doc) if args.json else json.dumps(doc, indent=2))
    return 0


def rollout_agent(config: Any, base: Path) -> int:
    """``--rollout-agent``: this node's agent of the run's rollout nodes
    (``pearl.run.rollout_nodes``), until the run ends or Slurm stops the job."""
    if config.cluster != "slurm":
        problem = "--rollout-agent needs --cluster slurm (or cluster: slurm)"
        raise InputError("<command line>", "--rollout-agent", problem)
    require("mpi4py")
    from pearl.run.local import model_path
    from pearl.run.rollout_nodes import rollout_agent as payload

    run_dir = (base / config.run_dir).resolve()  # the run writes the model: not made here
    return payload(config, run_dir, model_path(config, base, run_dir))()


def submit(args: argparse.Namespace, config: Any) -> int:
    """``--submit``: the run's job on Slurm (``pearl.run.submit``); prints its job id."""
    if config.cluster != "slurm" or args.config is None:
        problem = "--submit needs a configuration file and --cluster slurm (or cluster: slurm)"
        raise InputError("<command line>", "--submit", problem)
    if config.slurm.rollout is not None:
        problem = (
            "submitit cannot submit the heterogeneous job slurm.rollout asks for: "
            "sbatch [run options] : [rollout options] slurm/pearl-run.sbatch CONFIG"
        )
        raise InputError(args.config, "slurm.rollout", problem)
    require("submitit")
    from pearl.cluster.child_job import submit as submit_job
    from pearl.run.submit import run_job_spec

    overrides = [
        *(["--steps", str(args.steps)] if args.steps is not None else []),
        *(["--run-dir", str(config.run_dir)] if args.run_dir is not None else []),
        *(["--seed", str(args.seed)] if args.seed is not None else []),
    ]
    spec, command = run_job_spec(str(Path(args.config).resolve()), Path(args.folder))
    print(submit_job(spec, *command, *overrides))
    return 0
