"""``pearl run`` on one machine: engines, router, rollout manager and trainer, end to end.

    model      RUN_DIR/model (pearl's tiny Qwen3, unless the config names a directory)
    engines    `pearl engine serve` processes (logs in RUN_DIR/logs), colocated or P:D
    router     over them (docs/router.md), scraping their /metrics
    manager    the rollout (docs/agents.md): RUN_DIR/rollout/, RUN_DIR/rollout.jsonl,
               RUN_DIR/workload.json
    trainer    the reference trainer's loop (docs/training.md): batch k, update, commit
               (RUN_DIR/checkpoints/step-N), weights to every engine (RUN_DIR/weights/vN),
               the new version to the manager

A ``train_step`` record per update goes to the run log beside the rollout's records (the
batch's mean reward, the loss, the loss tokens, the weight sync's time), so
``pearl analyze RUN_DIR/rollout.jsonl`` reports the whole run.

Restart: the same command on the same run directory resumes: the manager replays its
journal, the trainer loads its last checkpoint and asks for the batch after it (the
spool holds a batch taken before the stop), and the run trains until ``trainer.steps``.

Not here yet (the rest of the `pearl run` issue): the coordinator's ``decide()`` in the
loop (lending the trainer's devices between updates, PD reconfiguration by plans, elastic
devices from the local allocation backend); the trainer as a process of its own; vLLM and
Megatron-core backends. The engines' PD configuration is the config's, fixed for the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pearl.agents.manager import RolloutManager
from pearl.bench.engine_proc import EngineProcess
from pearl.control.workers import free_port
from pearl.core.roles import Role
from pearl.engines.reference.tiny import init_model
from pearl.engines.reference.tokenizer import load
from pearl.envs import registry
from pearl.router.router import Router
from pearl.run.config import RunConfig
from pearl.run.control import TrainerSlot
from pearl.run.coordinated import coordinator_running, until_serving
from pearl.run.progress import RunDisplay, StepReport
from pearl.runlog.schema import RunEnded, TrainStep
from pearl.trainer.checkpoint import CheckpointDir
from pearl.trainer.loop import ManagerSource, train
from pearl.trainer.publish import WeightPublisher
from pearl.trainer.reference import ReferenceTrainer


@dataclass(frozen=True)
class RunResult:
    steps: list[StepReport]
    wall_s: float
    run_dir: Path


def model_dir(config: RunConfig, base: Path, run_dir: Path) -> Path:
    """The model the run trains: the config's directory, or the tiny default (made once)."""
    if config.model.dir is not None:
        return (base / config.model.dir).resolve()
    out = run_dir / "model"
    if not (out / "config.json").exists():
        init_model(out, seed=config.model.seed)
    return out


def roles(config: RunConfig) -> list[Role]:
    n = config.engines.count
    if config.engines.mode == "colocated":
        return [Role.COLOCATED] * n
    prefill = n // 2
    return [Role.PREFILL] * prefill + [Role.DECODE] * (n - prefill)


def pd_label(router: Router) -> str:
    """The PD configuration serving now: ``colocated x2``, ``1P:1D``."""
    serving = [i for i in router.table if i.accepting]
    counts = {r: sum(i.role is r for i in serving) for r in (Role.COLOCATED, Role.PREFILL)}
    decode = sum(i.role is Role.DECODE for i in serving)
    if counts[Role.PREFILL] or decode:
        return f"{counts[Role.PREFILL]}P:{decode}D"
    return f"colocated x{counts[Role.COLOCATED]}"


@contextlib.contextmanager
def engines_running(config: RunConfig, model: Path, run_dir: Path) -> Iterator[list[EngineProcess]]:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    e = config.engines
    extra = ("--max-num-seqs", str(e.max_num_seqs))
    procs = [
        EngineProcess(
            model,
            kv_port=free_port(),
            engine_id=f"e{i}",
            threads=e.threads,
            extra=extra,
            log_dir=logs,
        ).start()
        for i in range(e.count)
    ]
    try:
        for p in procs:
            p.wait_healthy()
        yield procs
    finally:
        for p in procs:
            p.stop()


async def run_local(config: RunConfig, base: Path, display: RunDisplay | None = None) -> RunResult:
    t0 = time.monotonic()
    run_dir = (base / config.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    model = model_dir(config, base, run_dir)
    note: Callable[[str], None] = display.note if display else (lambda _: None)
    coordinated = config.coordinator.enabled
    if not coordinated:
        note(f"starting {config.engines.count} engines on {model}")
    reports: list[StepReport] = []
    async with contextlib.AsyncExitStack() as stack:
        router = Router()
        stack.push_async_callback(router.aclose)
        if not coordinated:
            procs = stack.enter_context(engines_running(config, model, run_dir))
            for i, (p, role) in enumerate(zip(procs, roles(config), strict=True)):
                router.table.add(f"e{i}", p.url, role)
                router.table.ready(f"e{i}")
        manager = await RolloutManager.open(
            router,
            lambda: registry.make(config.env, "<config>"),
            load(model),
            config.rollout.manager_config(),
            run_dir,
        )
        trainer = ReferenceTrainer(model, config.trainer.optimizer)
        latest: list[tuple[Path, int]] = []  # the weights published last
        publisher = WeightPublisher(
            run_dir / "weights", lambda: {i.worker_id: i.url for i in router.table}
        )
        devices: TrainerSlot | None = None
        try:
            if coordinated:
                note("the coordinator decides: waiting for its first engines")
                devices = await stack.enter_async_context(
                    coordinator_running(
                        config,
                        model,
                        run_dir,
                        router,
                        trainer,
                        lambda: latest[-1] if latest else None,
                        manager.now_s,
                    )
                )
                await until_serving(router)
            manager.start()
            note("rollout running")
            last_s, last_tokens = time.monotonic(), manager.ledger.totals.consumed_tokens
            async for out in train(
                trainer,
                ManagerSource(manager),
                CheckpointDir(run_dir / "checkpoints"),
                config.trainer.steps,
                publisher,
                devices,
            ):
                m = out.metrics
                if out.published is not None:
                    latest.append((out.published.weights_dir, out.published.version))
                sync_s = out.published.duration_s if out.published else 0.0
                now_s = time.monotonic()
                tokens = manager.ledger.totals.consumed_tokens
                report = StepReport(
                    step=m.step,
                    version=m.version,
                    reward_mean=m.reward_mean,
                    loss=m.loss,
                    tokens_per_s=(tokens - last_tokens) / max(now_s - last_s, 1e-9),
                    batch_wait_s=max(now_s - last_s - m.time_s - sync_s, 0.0),
                    train_s=m.time_s,
                    sync_s=sync_s,
                    pd=pd_label(router),
                )
                last_s, last_tokens = now_s, tokens
                manager.log_record(
                    TrainStep.model_construct(
                        t=manager.now_s(),
                        step=m.step,
                        started_t=max(manager.now_s() - m.time_s - sync_s, 0.0),
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
            manager.log_record(RunEnded(t=manager.now_s(), reason="trained"))
        finally:
            await manager.close()
    return RunResult(reports, time.monotonic() - t0, run_dir)


def run(config: RunConfig, base: Path, show: bool = True) -> RunResult:
    if not show:
        return asyncio.run(run_local(config, base))
    with RunDisplay(config.trainer.steps) as display:
        return asyncio.run(run_local(config, base, display))
