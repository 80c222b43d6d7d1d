"""``pearl run`` with the coordinator (``coordinator.enabled``): decide() runs the engines.

The base job is ``coordinator.trainer_slots`` slots on node ``trainer`` (the trainer's) and
``coordinator.rollout_slots`` on node ``rollout``, GPU type ``cpu``; the run starts with no
engine but, with ``coordinator.asleep_engines``, an asleep one on each trainer slot
(those of the coordinator's initial state, ``pearl.core.base_job``, started and put to
sleep before the first decision; a resumed run starts none: the journal's died with its
incarnation). The coordinator's loop (``pearl.coordinator.loop.Coordinator``: observe ->
decide() -> journal -> act) runs in a thread of its own beside the asyncio data plane,
every ``coordinator.decision_interval_s``, with

- the workload the rollout manager writes (``RUN_DIR/workload.json``),
- the trainer's status (``pearl.run.control.TrainerSource``: waiting, needs its devices
  once its next batch is complete, training),
- ``LocalControl`` as its control plane: engines started, drained, put to sleep, woken,
  switched and stopped on the slots, the router's table following each step, the
  trainer offloaded and onloaded between updates (``TrainerSlot``),
- elastic slots (``coordinator.elastic_slots``, node ``localhost``): ``LocalBackend``'s
  allocations on the shipped availability windows, compressed
  (``pearl.run.elastic.ScheduledBackend``), asked for when the policy's elastic rule says
  they pay (its default here is ``never``); without them, a backend never asked.

Its journal (``RUN_DIR/journal.jsonl``) and run log (``RUN_DIR/events.jsonl``: GPU and
worker phases, decisions, plan steps, borrow windows) sit beside the rollout's; the two
logs share one clock, the rollout manager's (seconds since the run first started).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from pearl.agents.manager import RolloutManager
from pearl.cluster.backend import AllocationBackend
from pearl.cluster.local_backend import LOCAL_NODE, LocalBackend
from pearl.control.messages import Command
from pearl.coordinator.config import BaseJob, BaseNode, CoordinatorConfig, initial_state
from pearl.coordinator.loop import Coordinator, workload_file
from pearl.core.calibration import BatchCalibration, scaled_engines
from pearl.core.config import PolicyConfig
from pearl.core.decision import Decision, ElasticRequest
from pearl.core.limits import NonNegInt
from pearl.core.observation import Event, Observation
from pearl.core.plan import Action
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import Role, WorkerKind
from pearl.core.state import ClusterState, Frozen
from pearl.io.atomic import write_text_atomic
from pearl.io.documents import load_profile, parse, read_document
from pearl.router.plan_steps import PlanSteps
from pearl.router.router import Router
from pearl.run import stop_signal
from pearl.run.config import RunConfig, cluster_profile
from pearl.run.control import (
    LocalControl,
    LocalEngines,
    LocalServer,
    RouterListener,
    TrainerSlot,
    TrainerSource,
    TrainerWorkers,
    Weights,
    slot_cores,
)
from pearl.run.elastic import ScheduledBackend, compressed_windows
from pearl.run.engine_command import engine_template

if TYPE_CHECKING:
    from pearl.run.split_control import SplitControl

log = logging.getLogger(__name__)
SLOT_TYPE = "cpu"
CALIBRATION_FILE = "calibration.json"
TRAINER_NODE, ROLLOUT_NODE = "trainer", "rollout"


class NoElastic:
    """The allocation backend of a run without elastic devices: never asked for one."""

    def submit(self, request: ElasticRequest, allocation_id: str) -> None:
        raise RuntimeError("this run has no elastic devices (policy.elastic.rule: never)")

    def poll(self, now_s: float) -> list[Event]:
        return []

    def reattach(self, request: ElasticRequest, allocation_id: str) -> bool:
        return False

    def release(self, allocation_id: str) -> None:
        return None

    def job_id(self, allocation_id: str) -> str:
        raise KeyError(allocation_id)

    def close(self) -> None:
        return None


def coordinator_config(
    config: RunConfig, run_dir: Path, model: Path | None = None
) -> CoordinatorConfig:
    """The coordinator of the run: on this machine's slots, with elastic slots on
    ``localhost``, or (``cluster: slurm``) with Slurm's elastic jobs and their agents."""
    c = config.coordinator
    rollout: tuple[BaseNode, ...] = (
        BaseNode(name=ROLLOUT_NODE, gpu_type=SLOT_TYPE, num_gpus=c.rollout_slots),
    )
    if config.cluster == "slurm":  # and the nodes of the job's second component, if any
        from pearl.run.rollout_nodes import rollout_base_nodes

        rollout += rollout_base_nodes(config)
    base = BaseJob(
        trainer=(BaseNode(name=TRAINER_NODE, gpu_type=SLOT_TYPE, num_gpus=c.trainer_slots),),
        rollout=rollout,
        asleep_engines=c.asleep_engines,
    )
    common = {
        "schema_version": 1,
        "run_dir": str(run_dir),
        "profile": c.profile,
        "decision_interval_s": c.decision_interval_s,
        "base": base,
    }
    if config.cluster == "slurm":
        from pearl.run.on_slurm import agent_section, run_id

        s = config.slurm
        return CoordinatorConfig(
            **common,
            run_id=run_id(config, run_dir),
            backend="slurm",
            gpus_per_node=dict(s.gpus_per_node),
            qos=s.qos,
            poll_interval_s=s.poll_interval_s,
            policy=c.policy_config(),
            agents=agent_section(config, model or run_dir / "model"),
        )
    return CoordinatorConfig(
        **common,
        run_id="pearl-run",
        backend="local",
        gpus_per_node={SLOT_TYPE: 1},
        policy=_one_allocation(c.policy_config(), c.elastic_slots),
    )


def _one_allocation(policy: PolicyConfig, slots: int) -> PolicyConfig:
    """With elastic slots, one allocation of them at a time: ``LocalBackend`` grants every
    allocation on ``localhost``, GPU ids ``localhost/0..``, so two would share ids."""
    if not slots:
        return policy
    e = policy.elastic.model_copy(update={"gpus_per_allocation": slots, "max_allocations": 1})
    return policy.model_copy(update={"elastic": e})


@contextlib.asynccontextmanager
async def coordinator_running(
    config: RunConfig,
    model: Path,
    run_dir: Path,
    router: Router,
    trainer: Any,
    weights: Weights,
    manager: RolloutManager,
    base: Path | None = None,
) -> AsyncIterator[TrainerSlot]:
    """The coordinator deciding over this machine's slots (the module docstring); yields
    the trainer's devices, for the trainer's loop (``pearl.trainer.loop.train``). The
    run's clock is the manager's; the manager hears each decision's prediction of the
    batch being gathered (``note_prediction``), and each completed batch calibrates the
    profile the decisions predict with (``pearl.core.calibration``; kept in
    ``RUN_DIR/calibration.json``, so a resumed run predicts with it from its first
    decision)."""
    clock = manager.now_s
    c = config.coordinator
    slurm = config.cluster == "slurm"
    base = base or Path.cwd()  # the folder the config's relative paths start from
    cfg = coordinator_config(config, run_dir, model)
    profile = cluster_profile(config, base) if slurm else load_profile(c.profile)
    router.profile = profile  # weighs unequal instances (docs/router.md); not the calibrated
    # one: the calibration scales every engine alike, so the weights' ratios do not change
    slots = [f"{TRAINER_NODE}/{i}" for i in range(c.trainer_slots)]
    slots += [f"{ROLLOUT_NODE}/{i}" for i in range(c.rollout_slots)]
    if not slurm:  # LocalBackend's grants; on Slurm, the elastic nodes' agents run theirs
        slots += [f"{LOCAL_NODE}/{i}" for i in range(c.elastic_slots)]
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    engines = LocalEngines(
        {"*": engine_template(config, model)},
        {s: i for i, s in enumerate(slots)},
        log_dir=str(logs),
        # on Slurm, reachable from the elastic nodes' engines (a disaggregated pair's KV)
        host=socket.gethostname() if slurm else "127.0.0.1",
        weights=weights,
        cores=slot_cores(slots),
    )
    if slurm:  # this incarnation's job id in RUN_DIR/run.json: pearl analyze --sacct-query
        from pearl.coordinator.job import run_start_s

        run_start_s(run_dir)
    fresh = not (run_dir / "journal.jsonl").exists()
    try:
        if c.asleep_engines and fresh:
            await asyncio.to_thread(start_asleep, engines, initial_state(cfg))
        co, control, backend, slot = _opened(
            config, cfg, profile, run_dir, model, router, engines, weights, trainer, clock
        )
    except BaseException:  # no engine outlives a failed start
        await asyncio.to_thread(engines.stop_all, 15.0)
        raise
    if slurm and config.slurm.rollout is not None:  # the base rollout's agents, first
        from pearl.run.rollout_nodes import wait_for_rollout_agents

        try:
            await wait_for_rollout_agents(config, control, run_dir)
        except BaseException as err:  # a signal keeps the elastic jobs; a timeout ends the run
            stopped = isinstance(err, asyncio.CancelledError)
            co.close(None if stopped else "failed")
            if not stopped:
                await asyncio.to_thread(backend.close)
            await asyncio.to_thread(control.close, 15.0, stopped)
            raise
    aio = asyncio.get_running_loop()

    calibration = read_calibration(run_dir / CALIBRATION_FILE)  # a resumed run's, or none
    first = scaled_engines(profile, calibration.factor) if calibration.batches else profile
    co.profile = first
    factors = {id(first): (first, calibration.factor)}  # each profile predicted with, its factor

    def predicted(d: Decision, obs: Observation, used: RuntimeProfile) -> None:
        # on the coordinator's thread; the simulator's rule: no work left, no prediction
        if obs.workload.num_unfinished:
            factor = factors[id(used)][1]
            aio.call_soon_threadsafe(manager.note_prediction, d.time_s, d.predicted_s, factor)

    co.on_decision = predicted

    def calibrate(predicted_s: float | None, measured_s: float, factor_then: float) -> None:
        if predicted_s is not None:  # the coordinator's next decisions predict with it
            factor = calibration.observe(predicted_s, measured_s, factor_then)
            scaled = scaled_engines(profile, factor)
            factors[id(scaled)] = (scaled, factor)
            co.profile = scaled
            write_calibration(run_dir / CALIBRATION_FILE, calibration)
            log.info(
                "batch %.2f s, predicted %.2f s: engine costs x %.2f",
                measured_s,
                predicted_s,
                factor,
            )

    manager.on_batch_completed = calibrate
    stop = threading.Event()
    failed: list[BaseException] = []

    def loop() -> None:
        try:
            co.run(stop=stop.is_set)
        except BaseException as err:  # the run sees it: no silent end of decisions
            log.exception("the coordinator's loop ended")
            failed.append(err)

    thread = threading.Thread(target=loop, name="pearl-coordinator", daemon=True)
    thread.start()
    stopped = False  # by a signal: on Slurm, the next incarnation takes the elastic jobs over
    try:
        yield slot
    except asyncio.CancelledError:
        stopped = True
        raise
    finally:
        stop.set()
        await asyncio.to_thread(thread.join)
        cancelled = stopped and slurm and await asyncio.to_thread(_cancelled)
        co.close(ended_reason(stopped and not cancelled, cancelled, bool(failed)))
        # a requeue (or Slurm's warning): the elastic jobs and their agents wait for the
        # next incarnation; a cancel releases them
        restarting = stopped and slurm and not cancelled
        if not restarting:
            await asyncio.to_thread(backend.close)
        await asyncio.to_thread(control.close, 15.0, restarting)
        manager.on_batch_completed = None
    if failed:
        raise RuntimeError(f"the coordinator's loop failed: {failed[0]}") from failed[0]


def _cancelled() -> bool:
    """Whether the signal that stopped the run ends its job for good: a SIGTERM (``scancel``,
    the time limit) of a job Slurm is not requeueing (``pearl.cluster.own_job``). Slurm's
    warning (USR2), SIGHUP, or a job Slurm cannot say about: not."""
    if stop_signal.first() is not signal.SIGTERM:
        return False
    from pearl.cluster.own_job import requeued

    return requeued() is False


def ended_reason(goes_on: bool, cancelled: bool, failed: bool) -> str | None:
    """The run log's ``run_ended`` reason; None when the next incarnation goes on."""
    if goes_on:
        return None
    return "cancelled" if cancelled else "failed" if failed else "trained"


class CalibrationState(Frozen):
    """``RUN_DIR/calibration.json``: the online calibration, kept for a resumed run."""

    log_factor: float = Field(  # as BatchCalibration.observe keeps it
        ge=math.log(BatchCalibration.min_factor), le=math.log(BatchCalibration.max_factor)
    )
    batches: NonNegInt


def read_calibration(path: Path) -> BatchCalibration:
    """The calibration a run wrote, or a new one (1.0) without the file."""
    if not path.exists():
        return BatchCalibration()
    state = parse(CalibrationState, read_document(path), path)
    return BatchCalibration(log_factor=state.log_factor, batches=state.batches)


def write_calibration(path: Path, calibration: BatchCalibration) -> None:
    state = CalibrationState(log_factor=calibration.log_factor, batches=calibration.batches)
    write_text_atomic(path, state.model_dump_json() + "\n")


def _opened(
    config: RunConfig,
    cfg: CoordinatorConfig,
    profile: RuntimeProfile,
    run_dir: Path,
    model: Path,
    router: Router,
    engines: LocalEngines,
    weights: Weights,
    trainer: Any,
    clock: Callable[[], float],
) -> tuple[Coordinator, LocalControl | SplitControl, AllocationBackend, TrainerSlot]:
    """The coordinator opened over its control plane and elastic backend: this machine's
    (elastic slots on ``localhost``), or with ``cluster: slurm``, Slurm's elastic jobs and
    their agents beside this job's own nodes (``pearl.run.split_control``)."""
    c = config.coordinator
    status = TrainerSource(clock, profile.costs.train_step_s)
    slot = TrainerSlot(trainer, status)
    trainers = TrainerWorkers(slot, (f"t-{TRAINER_NODE}",))  # base_job's trainer worker
    slurm = config.cluster == "slurm"
    nodes = [TRAINER_NODE, ROLLOUT_NODE] if slurm else [TRAINER_NODE, ROLLOUT_NODE, LOCAL_NODE]
    server = LocalServer(nodes, engines, trainers)
    listener = RouterListener(PlanSteps(router), asyncio.get_running_loop(), timeout_s=30.0)
    local = LocalControl(server, listener, min_deadline_s=60.0)
    control: LocalControl | SplitControl = local
    backend: AllocationBackend = NoElastic()
    if slurm:
        from pearl.coordinator.control_plane import MpiControl
        from pearl.run.on_slurm import slurm_backend
        from pearl.run.split_control import ElasticEngines
        from pearl.run.split_control import SplitControl as Split

        backend = slurm_backend(config, run_dir, model)
        try:
            control = Split(local, MpiControl.open(run_dir), ElasticEngines(weights))
        except BaseException:
            local.close(15.0)
            raise
    elif c.elastic_slots:
        windows = compressed_windows(c.elastic_time_scale)
        inner = LocalBackend(run_dir / "elastic", signal_delay_s=1)
        backend = ScheduledBackend(inner, windows, offset_s=c.elastic_offset_s)
    try:
        co = Coordinator.open(
            cfg,
            profile,
            run_dir,
            backend,
            clock,
            workload_file(run_dir / "workload.json"),
            control,
            status,
        )
    except BaseException:  # no control plane (MPI port, threads, port file) outlives it
        control.close(15.0, restarting=slurm)
        raise
    return co, control, backend, slot


def start_asleep(engines: LocalEngines, state: ClusterState, timeout_s: float = 300.0) -> None:
    """The asleep engines of the run's initial state (``base.asleep_engines``: one on each
    trainer slot), started and put to sleep as the state names and places them."""
    asleep = [w for w in state.workers if w.kind is WorkerKind.ENGINE and w.role is Role.IDLE]
    for step_id, w in enumerate(asleep):
        for action, role in ((Action.START, Role.COLOCATED), (Action.SLEEP, Role.IDLE)):
            cmd = Command(
                cmd_id=f"asleep-{step_id}-{action.value}",
                step_id=step_id,
                action=action,
                worker_id=w.worker_id,
                gpu_ids=w.gpu_ids,
                role=role,
                deadline_s=timeout_s,
            )
            engines.execute(cmd)


async def until_serving(router: Router, timeout_s: float = 300.0) -> None:
    """Until the router has an instance that takes turns (the first plan's engines)."""
    end = asyncio.get_running_loop().time() + timeout_s
    while not any(i.accepting for i in router.table):
        if asyncio.get_running_loop().time() > end:
            raise RuntimeError(f"no engine serving after {timeout_s:.0f} s of decisions")
        await asyncio.sleep(0.2)
