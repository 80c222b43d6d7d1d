"""The coordinator job's wiring: one incarnation of ``pearl coordinator CONFIG``.

``run_job`` loads the configuration and the profile, continues the run clock (seconds since
the run first started, ``RUN_DIR/run.json``, so a requeued coordinator continues the same
clock and journal), builds the allocation backend (``make_backend``: Slurm or local, each
allocation running the node agent when agents are configured) and the control plane,
opens the coordinator (``Coordinator.open``) and ticks until it is told to stop.

SIGTERM or SIGUSR2 (Slurm's warning before preemption or the time limit) ends it after the
current tick, leaving its elastic jobs to the next incarnation; reaching
``max_runtime_s`` ends the run and releases them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from pearl.cluster.agent_payload import AgentPayload
from pearl.cluster.backend import AllocationBackend, AllocationConfigError
from pearl.cluster.local_backend import LocalBackend
from pearl.cluster.slurm_backend import SlurmBackend
from pearl.coordinator.config import CoordinatorConfig, load_config
from pearl.coordinator.control_plane import MpiControl
from pearl.coordinator.loop import Coordinator, workload_file
from pearl.io.atomic import write_text_atomic
from pearl.io.documents import InputError, load_profile, read_object
from pearl.io.extras import require


def run_start_s(run_dir: Path) -> float:
    """Wall time at which the run first started (``RUN_DIR/run.json``, written once); the
    Slurm job of every incarnation is added to its ``slurm_job_ids`` (for accounting)."""
    path = run_dir / "run.json"
    doc = read_object(path) if path.exists() else {}
    doc.setdefault("started_at_unix_s", time.time())
    started = doc["started_at_unix_s"]
    if isinstance(started, bool) or not isinstance(started, int | float) or started < 0:
        raise InputError(path, "started_at_unix_s", f"must be a time, not {started!r}")
    job_id = os.environ.get("SLURM_JOB_ID")
    ids = doc.setdefault("slurm_job_ids", [])
    if not isinstance(ids, list):
        raise InputError(path, "slurm_job_ids", "must be a list of job ids")
    if job_id and job_id not in ids:
        ids.append(job_id)
    write_text_atomic(path, json.dumps(doc) + "\n")
    return float(doc["started_at_unix_s"])


def make_backend(config: CoordinatorConfig, run_dir: Path) -> AllocationBackend:
    a = config.agents
    payload = None
    if a is not None:
        gpu_type = config.policy.elastic.gpu_type
        engines = a.engine_commands(sys.executable)  # agents run pearl's interpreter too
        payload = AgentPayload(
            str(run_dir), gpu_type, engines, a.null_workers, a.grace_s, engine_host=a.engine_host
        )
    if config.backend == "local":
        return LocalBackend(run_dir / "jobs", payload=payload)
    return SlurmBackend(
        config.run_id,
        run_dir / "jobs",
        dict(config.gpus_per_node),
        config.poll_interval_s,
        qos=config.qos,
        payload=payload,
    )


def run_job(config_path: str, max_runtime_s: float | None = None) -> int:
    """One incarnation of the coordinator of the run ``config_path`` describes."""
    config, run_dir = load_config(config_path)
    if config.agents is not None:
        require("mpi4py")  # the control plane to the agents
    profile = load_profile(config.profile, relative_to=Path(config_path).parent)
    start_s = run_start_s(run_dir)
    backend = make_backend(config, run_dir)
    stopping = {"signal": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(sig, on_signal)
    agents = config.agents
    control = MpiControl.open(run_dir, agents.router_url) if agents is not None else None
    try:
        coordinator = Coordinator.open(
            config,
            profile,
            run_dir,
            backend,
            clock=lambda: time.time() - start_s,
            workload=workload_file(run_dir / "workload.json"),
            control=control,
        )
    except BaseException:
        if control is not None:
            control.close()
        raise
    ended: str | None = None  # a crash: the run may go on in a requeued incarnation
    try:
        coordinator.run(max_runtime_s, stop=lambda: bool(stopping["signal"]))
        ended = None if stopping["signal"] else "max runtime reached"
    except AllocationConfigError as err:  # Slurm refused a value of the configuration
        ended = f"Slurm refused {err.field_name}"
        raise InputError(config_path, err.field_name, err.detail) from None
    finally:
        coordinator.close(ended)
        if control is not None:  # a signalled coordinator's agents wait for the next one
            control.close(restarting=bool(stopping["signal"]))
    if not stopping["signal"]:
        backend.close()  # a run that ended releases its allocations; a signalled one keeps them
    return 0
