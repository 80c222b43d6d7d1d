"""``pearl run`` on one machine: engines, router, rollout manager and trainer, end to end.

    model      RUN_DIR/model (pearl's tiny Qwen3, unless the config names a directory)
    engines    `pearl engine serve` processes (logs in RUN_DIR/logs), colocated or P:D
    router     over them (docs/router.md), scraping their /metrics
    manager    the rollout (docs/agents.md): RUN_DIR/rollout/, RUN_DIR/rollout.jsonl,
               RUN_DIR/workload.json
    trainer    `pearl trainer serve`, a process of its own (RUN_DIR/logs/trainer.log),
               driven over HTTP by the trainer's loop (docs/training.md): batch k, update,
               commit (RUN_DIR/checkpoints/step-N), weights to every engine
               (RUN_DIR/weights/vN), the new version to the manager; a trainer process
               that dies is restarted from its last checkpoint (``trainer.process: false``:
               the trainer in the run's process)

A ``train_step`` record per update goes to the run log beside the rollout's records (the
batch's mean reward, the loss, the loss tokens, the weight sync's time), so
``pearl analyze RUN_DIR/rollout.jsonl`` reports the whole run.

Restart: the same command on the same run directory resumes: the manager replays its
journal, the trainer loads its last checkpoint and asks for the batch after it (the
spool holds a batch taken before the stop), and the run trains until ``trainer.steps``.

With ``coordinator.enabled`` (``pearl/run/coordinated.py``, docs/run.md), the engines are
not the config's: the coordinator's ``decide()`` places them on this machine's slots, lends
the trainer's slot between updates and asks for elastic slots, through the same executor
as on Slurm (``pearl/run/control.py``). Not here yet: vLLM and Megatron-core as backends of
``pearl run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from pearl.agents.manager import RUN_LOG, RolloutManager
from pearl.bench.engine_proc import EngineProcess
from pearl.control.workers import free_port
from pearl.core.roles import Phase, Role
from pearl.engines.reference.tiny import init_model
from pearl.engines.reference.tokenizer import load
from pearl.envs import registry
from pearl.router.router import Router
from pearl.run import stop_signal
from pearl.run.config import RunConfig
from pearl.run.control import TrainerSlot
from pearl.run.coordinated import ROLLOUT_NODE, TRAINER_NODE, coordinator_running, until_serving
from pearl.run.progress import RunDisplay, StepReport
from pearl.runlog.jsonl import read_records
from pearl.runlog.schema import RunEnded, TrainStep
from pearl.trainer.checkpoint import CheckpointDir
from pearl.trainer.config import TrainerConfig
from pearl.trainer.loop import ManagerSource, resume_published, train
from pearl.trainer.protocol import Trainer
from pearl.trainer.publish import PublishResult, WeightPublisher
from pearl.trainer.reference import ReferenceTrainer
from pearl.trainer.remote import RemoteTrainer, TrainerLost, TrainerProcess

log = logging.getLogger(__name__)
MAX_TRAINER_RESTARTS = 3  # a trainer process lost more often than this ends the run


class RunStopped(Exception):
    """A signal stopped the run, cleanly: the same command on its directory resumes it."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(f"stopped by {sig.name}")
        self.signal = sig


@dataclass(frozen=True)
class RunResult:
    steps: list[StepReport]
    wall_s: float
    run_dir: Path
    generated_tokens: int  # by the rollout in this invocation
    trainer_restarts: int = 0  # trainer processes lost and started again


def model_path(config: RunConfig, base: Path, run_dir: Path) -> Path:
    """Where the model the run trains is: the config's directory, or ``RUN_DIR/model``."""
    if config.model.dir is not None:
        return (base / config.model.dir).resolve()
    return run_dir / "model"


def model_dir(config: RunConfig, base: Path, run_dir: Path) -> Path:
    """The model the run trains: the config's directory, or the tiny default (made once)."""
    out = model_path(config, base, run_dir)
    if config.model.dir is None and not (out / "config.json").exists():
        init_model(out, seed=config.model.seed)
    return out


def roles(config: RunConfig) -> list[Role]:
    n = config.engines.count
    if config.engines.mode == "colocated":
        return [Role.COLOCATED] * n
    prefill = n // 2
    return [Role.PREFILL] * prefill + [Role.DECODE] * (n - prefill)


def pd_label(router: Router) -> str:
    """The PD configuration serving now, as decisions label it: ``2C``, ``1P:1D``."""
    serving = [i for i in router.table if i.accepting]
    counts = {r: sum(i.role is r for i in serving) for r in (Role.COLOCATED, Role.PREFILL)}
    decode = sum(i.role is Role.DECODE for i in serving)
    if counts[Role.PREFILL] or decode:
        return f"{counts[Role.PREFILL]}P:{decode}D"
    return f"{counts[Role.COLOCATED]}C"


def elastic_serving(router: Router) -> int:
    """Engines serving on elastic devices: off the base job's nodes (the coordinator names
    its engines ``e-NODE-INDEX``; ``localhost``'s on one machine, a Slurm node's on
    Slurm). A run without the coordinator has none (its engines are ``eN``)."""
    base = tuple(f"e-{node}-" for node in (TRAINER_NODE, ROLLOUT_NODE))
    return sum(
        i.accepting and i.worker_id.startswith("e-") and not i.worker_id.startswith(base)
        for i in router.table
    )


@contextlib.asynccontextmanager
async def engines_running(
    config: RunConfig, model: Path, run_dir: Path
) -> AsyncIterator[list[EngineProcess]]:
    """The run's engines, started side by side and healthy; every one started is stopped
    on the way out, whatever ends the run."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    e = config.engines
    procs: list[EngineProcess] = []
    try:
        for i in range(e.count):
            proc = EngineProcess(
                model,
                kv_port=free_port(),
                engine_id=f"e{i}",
                threads=e.threads,
                extra=("--max-num-seqs", str(e.max_num_seqs)),
                log_dir=logs,
            )
            procs.append(proc.start())
        for p in procs:
            await asyncio.to_thread(p.wait_healthy)
        yield procs
    finally:
        for p in procs:
            p.stop()


def trainer_config(config: RunConfig, run_dir: Path) -> TrainerConfig:
    """The trainer's settings as the run gives them: without ``threads``, a slot's share of
    the cores (at least one; more threads than that stall on the cores the engines hold),
    and without ``offload_dir``, ``RUN_DIR/trainer-offload``."""
    t = config.trainer.optimizer
    c = config.coordinator
    slots = (
        c.trainer_slots + c.rollout_slots + c.elastic_slots
        if c.enabled
        else config.engines.count + 1
    )
    threads = t.threads or max(1, len(os.sched_getaffinity(0)) // slots)
    offload_dir = t.offload_dir or run_dir / "trainer-offload"
    return t.model_copy(update={"threads": threads, "offload_dir": offload_dir})


def trainer_process(config: RunConfig, model: Path, run_dir: Path) -> TrainerProcess:
    """``pearl trainer serve`` as the run starts it (not started yet): its backend, with its
    options (``trainer.megatron``), and the run's optimiser settings."""
    t = config.trainer
    options = t.megatron if t.backend == "megatron" else None
    optimizer = trainer_config(config, run_dir)
    return TrainerProcess(model, optimizer, run_dir / "logs", t.backend, options)


@contextlib.asynccontextmanager
async def trainer_running(
    config: RunConfig, model: Path, run_dir: Path
) -> AsyncIterator[tuple[Trainer, TrainerProcess | None]]:
    """The run's trainer: with ``trainer.process``, ``pearl trainer serve`` as a child
    process (log: RUN_DIR/logs/trainer.log) and its client; else one in this process."""
    optimizer = trainer_config(config, run_dir)
    if not config.trainer.process:
        yield ReferenceTrainer(model, optimizer), None
        return
    process = trainer_process(config, model, run_dir)
    try:
        await asyncio.to_thread(process.start)
        remote = RemoteTrainer(process.url)
        try:
            yield remote, process
        finally:
            remote.close()
    finally:
        await asyncio.to_thread(process.stop)


class RunStateError(ValueError):
    """The run directory's books disagree (checkpoints against the rollout's journal)."""


def check_books(manager: RolloutManager, step: int, run_dir: Path) -> None:
    """After a resume the trainer's next step ``step`` and the rollout's books must agree:
    batch ``step`` taken or next, the weights those of ``step`` or the one before."""
    led = manager.ledger
    if led.totals.batches not in (step, step + 1) or led.version not in (step - 1, step):
        raise RunStateError(
            f"{run_dir}: checkpoints: the trainer resumes at step {step}, but the rollout's "
            f"journal has taken {led.totals.batches} batches at version {led.version} "
            "(checkpoints or journal removed or from another run?)"
        )


def reload_failures(
    router: Router, published: PublishResult | None, note: Callable[[str], None]
) -> None:
    """An engine that did not take the new weights leaves the router (it would go on
    serving old ones); none taking them ends the run."""
    if published is None or not published.failed:
        return
    for failure in published.failed:
        if failure.name in router.table:
            router.table.remove(failure.name)
        note(f"engine {failure.name} left the rollout: weights not reloaded: {failure.error}")
    if not published.reloaded:
        raise RuntimeError(f"no engine took the weights of version {published.version}")


async def run_local(config: RunConfig, base: Path, display: RunDisplay | None = None) -> RunResult:
    t0 = time.monotonic()
    run_dir = (base / config.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    model = model_dir(config, base, run_dir)
    note: Callable[[str], None] = display.note if display else (lambda _: None)
    reports: list[StepReport] = []
    latest: list[tuple[Path, int]] = []  # the weights published last: where, which version
    router = Router()
    manager = await RolloutManager.open(  # the journal first: a bad one stops the run here
        router,
        lambda: registry.make(config.env, base / "<config>", relative_to=base),
        load(model),
        config.rollout.manager_config(),
        run_dir,
    )
    process: TrainerProcess | None = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            devices: TrainerSlot | None = None
            running = trainer_running(config, model, run_dir)
            trainer, process = await stack.enter_async_context(running)
            if config.coordinator.enabled:
                note("the coordinator decides: waiting for its first engines")
                devices = await stack.enter_async_context(
                    coordinator_running(
                        config,
                        model,
                        run_dir,
                        router,
                        trainer,
                        lambda: latest[-1] if latest else None,
                        manager,
                        base,
                    )
                )
                await until_serving(router)
            else:
                note(f"starting {config.engines.count} engines on {model}")
                procs = await stack.enter_async_context(engines_running(config, model, run_dir))
                for i, (p, role) in enumerate(zip(procs, roles(config), strict=True)):
                    router.table.serve(f"e{i}", p.url, role)
            stack.push_async_callback(manager.close)  # before the engines stop
            publisher = WeightPublisher(
                run_dir / "weights",
                lambda: {i.worker_id: i.url for i in router.table if i.phase is not Phase.GONE},
                loaded=router.table.weights_loaded,
            )
            source = ManagerSource(manager)
            checkpoints = CheckpointDir(run_dir / "checkpoints")
            step, published = await resume_published(trainer, source, checkpoints, publisher)
            if step > 0:
                logged = logged_steps(run_dir / RUN_LOG)
                _resumed(manager, router, published, logged, step, latest, note)
            check_books(manager, step, run_dir)
            manager.start()  # after the resume's weights are on the engines
            note("rollout running")
            lost: TrainerLost | None = None
            while True:  # a trainer process lost is restarted from its last checkpoint
                try:
                    if lost is not None:
                        assert process is not None
                        trained = reports[-1].step + 1 if reports else step
                        step, published = await _recovered(
                            process, trainer, source, checkpoints, publisher, devices, lost, note
                        )
                        lost = None
                        _resumed(manager, router, published, trained, step, latest, note)
                    await _train(
                        config,
                        manager,
                        router,
                        trainer,
                        source,
                        checkpoints,
                        publisher,
                        step,
                        reports,
                        display,
                        devices,
                        latest,
                    )
                    break
                except TrainerLost as err:
                    if process is None or process.restarts >= MAX_TRAINER_RESTARTS:
                        raise
                    lost = err
            manager.log_record(RunEnded(t=manager.now_s(), reason="trained"))
    finally:
        await manager.close()  # (a second close does nothing)
        await router.aclose()
    restarts = process.restarts if process is not None else 0
    return RunResult(reports, time.monotonic() - t0, run_dir, manager.generated_tokens, restarts)


async def _recovered(
    process: TrainerProcess,
    trainer: Trainer,
    source: ManagerSource,
    checkpoints: CheckpointDir,
    publisher: WeightPublisher,
    devices: TrainerSlot | None,
    lost: TrainerLost,
    note: Callable[[str], None],
) -> tuple[int, PublishResult | None]:
    """A new trainer process in place of the lost one, resumed from the last checkpoint
    (its weights published again); the step to train next, and the publish. It holds the
    trainer's devices meanwhile, so that no lend lands in the middle of the restart."""
    log.warning("the trainer's process was lost (%s): restarting it", lost)
    note(f"the trainer's process was lost ({lost}): restarting it")
    async with devices.update() if devices is not None else contextlib.nullcontext():
        await asyncio.to_thread(process.restart)
        step, published = await resume_published(trainer, source, checkpoints, publisher)
    note(f"the trainer resumed at step {step}")
    return step, published


def _resumed(
    manager: RolloutManager,
    router: Router,
    published: PublishResult | None,
    logged: int,
    step: int,
    latest: list[tuple[Path, int]],
    note: Callable[[str], None],
) -> None:
    """After a resume from checkpoint ``step`` (the run's start, or a new trainer
    process): the resumed weights are the latest (engines started later load them), an
    engine that did not reload them leaves, and the updates committed but never logged
    (``logged`` on) get their ``train_step`` records (``log_unreported``)."""
    reload_failures(router, published, note)
    if published is not None:
        latest.append((published.weights_dir, published.version))
    log_unreported(manager, logged, step)


def logged_steps(run_log: Path) -> int:
    """The updates the run log has a ``train_step`` record of (the last one's step + 1)."""
    if not run_log.exists():
        return 0
    steps = [r.step for r in read_records(run_log) if isinstance(r, TrainStep)]
    return max(steps) + 1 if steps else 0


def log_unreported(manager: RolloutManager, logged: int, step: int) -> None:
    """A ``train_step`` record for each update committed (a checkpoint) but never logged:
    its trainer died, or the run was killed, between the checkpoint and the record. The
    metrics died with it."""
    t = manager.now_s()
    for k in range(logged, step):
        manager.log_record(
            TrainStep.model_construct(
                t=t, step=k, started_t=t, policy_version=k + 1, waited_for_gpus_s=0.0
            )
        )


async def _train(
    config: RunConfig,
    manager: RolloutManager,
    router: Router,
    trainer: Trainer,
    source: ManagerSource,
    checkpoints: CheckpointDir,
    publisher: WeightPublisher,
    step: int,
    reports: list[StepReport],
    display: RunDisplay | None,
    devices: TrainerSlot | None,
    latest: list[tuple[Path, int]],
) -> None:
    note: Callable[[str], None] = display.note if display else (lambda _: None)
    last_s, last_tokens = time.monotonic(), manager.generated_tokens
    last_offloads = devices.offloads if devices else 0
    async for out in train(
        trainer,
        source,
        checkpoints,
        config.trainer.steps,
        publisher,
        resumed=step,
        devices=devices,
    ):
        reload_failures(router, out.published, note)
        if out.published is not None:
            latest.append((out.published.weights_dir, out.published.version))
        m = out.metrics
        sync_s = out.published.duration_s if out.published else 0.0
        now_s = time.monotonic()
        report = StepReport(
            step=m.step,
            version=m.version,
            reward_mean=m.reward_mean,
            loss=m.loss,
            tokens_per_s=(manager.generated_tokens - last_tokens) / max(now_s - last_s, 1e-9),
            batch_wait_s=out.batch_wait_s,
            train_s=m.time_s,
            sync_s=sync_s,
            pd=pd_label(router),
            lent=(devices.offloads - last_offloads) if devices else 0,
            elastic=elastic_serving(router),
        )
        last_s, last_tokens = now_s, manager.generated_tokens
        last_offloads = devices.offloads if devices else 0
        t = manager.now_s()
        manager.log_record(
            TrainStep.model_construct(
                t=t,
                step=m.step,
                started_t=max(t - out.elapsed_s, 0.0),
                policy_version=m.version,
                waited_for_gpus_s=devices.last_wait_s if devices else 0.0,
                reward_mean=m.reward_mean,
                loss=m.loss,
                tokens=m.tokens,
                sync_s=sync_s,
            )
        )
        reports.append(report)
        if display:
            display.step(report)


def run(config: RunConfig, base: Path, show: bool = True) -> RunResult:
    """The run, to its end or to SIGINT / SIGTERM (which stop it as cleanly: the engines
    stopped, the manager's books closed; the same command resumes it)."""

    async def main(display: RunDisplay | None) -> RunResult:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        received: list[signal.Signals] = []

        def stop(sig: signal.Signals) -> None:
            if received:  # a second signal must not cut the first one's clean stop short
                return
            received.append(sig)
            stop_signal.note(sig)
            task.cancel()

        stop_signal.clear()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2):  # USR2: Slurm's warning
            loop.add_signal_handler(sig, stop, sig)
        try:
            return await run_local(config, base, display)
        except asyncio.CancelledError:
            if received:
                raise RunStopped(received[0]) from None
            raise

    if not show:
        return asyncio.run(main(None))
    with RunDisplay(config.trainer.steps) as display:
        return asyncio.run(main(display))
