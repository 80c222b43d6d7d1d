"""The runtime profile of pearl's tiny model on this machine: ``pearl/profiles/tiny-cpu.yaml``.

    python benchmarks/fit_tiny_profile.py [--out pearl/profiles/tiny-cpu.yaml] [--threads 1]

1. the tiny Qwen3 (``pearl.engines.reference.tiny.init_model``, seed 0) in a temporary
   directory; one reference engine (``pearl engine serve``) on it: its cold start (start
   to ``/health``) measured;
2. the engine's prefill and decode costs fitted by ``pearl profile fit``
   (``pearl.bench.profile_fit.fit_profile``, GPU type ``cpu``) on a small sweep;
3. the transitions measured on that engine (sleep, wake, weight sync: export plus reload)
   and on the reference trainer (one GRPO update on a batch of the run's default shape:
   16 groups of 4, 32-token prompts, 16 generated tokens; offload; onload), each the
   median of a few repetitions;
4. written with its source command and the measured numbers in the header; the role
   switch and migrate costs are the engine's routing changes (no process work: 0.05 s),
   the stop cost a SIGTERM's (measured).

The numbers are this machine's (and its load's); regenerate them on the machine that runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from pearl.agents.batches import RolloutBatch
from pearl.agents.loop import Trajectory
from pearl.bench.engine_proc import EngineProcess
from pearl.bench.profile_fit import fit_profile
from pearl.engines.client import EngineClient
from pearl.engines.reference.tiny import init_model
from pearl.io.documents import load_profile
from pearl.trainer.reference import ReferenceTrainer

COMMAND = "python benchmarks/fit_tiny_profile.py"


def median_s(fn: Callable[[], object], n: int = 3) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def batch(version: int, groups: int = 16, group: int = 4) -> RolloutBatch:
    """Random trajectories of the default run's shape (the update's cost, not its sense)."""
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(groups * group):
        prompt = torch.randint(256, 496, (32,), generator=gen).tolist()
        output = torch.randint(256, 496, (16,), generator=gen).tolist()
        t = Trajectory(f"t{i}", reward=float(i % 2), end_reason="answered")
        t.append(prompt, generated=False)
        t.append(output, generated=True, logprobs=[-1.0] * 16, versions=[version] * 16)
        trajs.append(t)
    return RolloutBatch(
        batch_id=0,
        policy_version=version,
        trajectories=tuple(trajs),
        group_ids=tuple(i // group for i in range(len(trajs))),
        off_policy_tokens=0,
        max_staleness_versions=0,
        mean_staleness_versions=0.0,
    )


def measure(out: Path, threads: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="pearl-tiny-") as tmp:
        model = init_model(Path(tmp) / "tiny")
        proc = EngineProcess(model, threads=threads, log_dir=tmp)
        t0 = time.perf_counter()
        with proc:
            proc.wait_healthy()
            cold_s = time.perf_counter() - t0
            fit_profile(
                proc.url,
                out,
                batches=(1, 4, 8),
                contexts=(32, 128),
                decode_tokens=8,
                model_dir=model,
                gpu_type="cpu",
            )

            def engine(op: Callable[[EngineClient], object]) -> Callable[[], object]:
                async def run() -> None:
                    async with EngineClient(proc.url, timeout_s=120.0) as c:
                        await op(c)  # type: ignore[misc]

                return lambda: asyncio.run(run())

            sleep_s = median_s(engine(lambda c: c.sleep(1)), 1)
            wake_s = median_s(engine(lambda c: c.wake_up()), 1)
            trainer = ReferenceTrainer(model)
            train_s = median_s(lambda: trainer.train_step(batch(trainer.version)), 3)
            offload_s = median_s(trainer.offload, 1)
            onload_s = median_s(trainer.onload, 1)
            weights = Path(tmp) / "weights"

            def sync() -> None:
                path = trainer.export_weights(weights)
                version = trainer.version
                engine(lambda c: c.reload_weights(weights_path=str(path), weight_version=version))()

            sync_s = median_s(sync, 3)
            t1 = time.perf_counter()
        stop_s = time.perf_counter() - t1
    return {
        "engine_cold_start_s": cold_s,
        "wake_s": wake_s,
        "sleep_s": sleep_s,
        "role_switch_s": 0.05,
        "migrate_s": 0.05,
        "stop_s": stop_s,
        "weight_sync_s": sync_s,
        "trainer_offload_s": offload_s,
        "trainer_onload_s": onload_s,
        "train_step_s": train_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("pearl/profiles/tiny-cpu.yaml"))
    p.add_argument("--threads", type=int, default=1, help="the engine's --threads")
    a = p.parse_args(argv)
    costs = measure(a.out, a.threads)
    fitted = a.out.read_text().splitlines()
    header = [  # the costs are measured here now, not copied
        line.replace("# costs and workload (copied", "# workload (copied")
        for line in fitted
        if line.startswith("#")
    ]
    profile = load_profile(str(a.out.resolve()))
    rounded = {k: round(v, 3) for k, v in costs.items()}
    profile = profile.model_copy(update={"costs": profile.costs.model_copy(update=rounded)})
    lines = [
        f"# Regenerate: {COMMAND} (benchmarks/fit_tiny_profile.py: the method).",
        "# The tiny Qwen3 (init_model, seed 0) on this CPU machine, GPU type 'cpu': a slot.",
        "# MEASURED HERE (costs): engine cold start, sleep, wake, stop (a reference engine,",
        f"# --threads {a.threads}); weight sync (export + reload); the reference trainer's",
        "# update (16 groups of 4, 32 + 16 tokens), offload and onload. role_switch_s and",
        "# migrate_s: routing changes, 0.05 s. The fit's own header follows.",
        *header,
    ]
    body = yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False)
    text = "\n".join(lines) + "\n\n" + body
    a.out.write_text(text)
    print(yaml.safe_dump({"costs": rounded}, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
