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
import contextlib
import statistics
import sys
import tempfile
import threading
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
from pearl.runlog.jsonl import read_records
from pearl.runlog.schema import TrajectoryFinished, TurnEnded
from pearl.trainer.reference import ReferenceTrainer

COMMAND = "python benchmarks/fit_tiny_profile.py"


def median_s(fn: Callable[[], object], n: int = 3) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


GROUPS, PROMPT_TOKENS, OUTPUT_TOKENS = 64, 24, 48  # the embedded default's update


def batch(version: int, groups: int = GROUPS, group: int = 4) -> RolloutBatch:
    """Random trajectories of the default run's shape (the update's cost, not its sense)."""
    gen = torch.Generator().manual_seed(0)
    trajs = []
    n = OUTPUT_TOKENS
    for i in range(groups * group):
        prompt = torch.randint(256, 496, (PROMPT_TOKENS,), generator=gen).tolist()
        output = torch.randint(256, 496, (n,), generator=gen).tolist()
        t = Trajectory(f"t{i}", reward=float(i % 2), end_reason="answered")
        t.append(prompt, generated=False)
        t.append(output, generated=True, logprobs=[-1.0] * n, versions=[version] * n)
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


class SteadyLoad:
    """``concurrency`` requests of ``max_tokens`` tokens at a time, over and over, on each
    engine of ``urls``, in a thread of its own: the load a run's other slots carry while
    one slot is fitted (on a machine whose slots share cores, what a slot delivers then)."""

    def __init__(self, urls: list[str], concurrency: int = 32, max_tokens: int = 16) -> None:
        self.urls, self.concurrency, self.max_tokens = urls, concurrency, max_tokens
        self._stop = threading.Event()
        self.failed: Exception | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        async def one(url: str) -> None:
            async with EngineClient(url, timeout_s=120.0) as c:
                name = (await c.models())["data"][0]["id"]
                body = {"model": name, "prompt": [300] * 24, "max_tokens": self.max_tokens}
                body |= {"temperature": 0.0, "ignore_eos": True}
                while not self._stop.is_set():
                    await c.completions(body)

        try:
            await asyncio.gather(*(one(u) for u in self.urls for _ in range(self.concurrency)))
        except Exception as err:  # the fit must not run unloaded without a word
            self.failed = err

    def __enter__(self) -> SteadyLoad:
        if self.urls:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.urls:
            self._thread.join(timeout=60.0)
        if self.failed is not None:
            raise RuntimeError(f"the steady load stopped during the fit: {self.failed}")


def measure(out: Path, threads: int, loaded: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="pearl-tiny-") as tmp:
        model = init_model(Path(tmp) / "tiny")
        proc = EngineProcess(model, threads=threads, log_dir=tmp)
        others = [EngineProcess(model, threads=threads, log_dir=tmp) for _ in range(loaded)]
        t0 = time.perf_counter()
        with proc, contextlib.ExitStack() as stack:
            proc.wait_healthy()
            cold_s = time.perf_counter() - t0
            for o in others:
                stack.enter_context(o)
            for o in others:
                o.wait_healthy()
            with SteadyLoad([o.url for o in others]):
                fit_profile(
                    proc.url,
                    out,
                    batches=(1, 8, 32),
                    contexts=(32, 128),
                    decode_tokens=16,
                    model_dir=model,
                    gpu_type="cpu",
                )
            stack.close()  # the loaded engines stop before the costs are measured

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


def workload_of(run_log: Path) -> dict[str, float]:
    """The workload defaults a ``pearl run``'s log shows (``trajectory_finished`` and
    ``turn_ended`` records, read by ``pearl.runlog.jsonl.read_records``): means per
    trajectory and per turn."""
    finished: list[TrajectoryFinished] = []
    env_s: list[float] = []
    for r in read_records(run_log):
        if isinstance(r, TrajectoryFinished) and r.prompt_tokens is not None:
            finished.append(r)
        elif isinstance(r, TurnEnded) and r.env_s is not None:
            env_s.append(r.env_s)
    if not finished:
        raise SystemExit(f"{run_log}: no trajectory_finished record with prompt_tokens")
    turns = sum(r.num_turns for r in finished)
    return {
        "prompt_tokens": statistics.mean(r.prompt_tokens or 0 for r in finished),
        "output_tokens_per_turn": sum(r.output_tokens for r in finished) / turns,
        "observation_tokens_per_turn": sum(r.observation_tokens or 0 for r in finished) / turns,
        "env_latency_s": statistics.mean(env_s) if env_s else 0.0,
        "turns_per_trajectory": turns / len(finished),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("pearl/profiles/tiny-cpu.yaml"))
    p.add_argument("--threads", type=int, default=1, help="the engine's --threads")
    p.add_argument(
        "--loaded",
        type=int,
        default=1,
        help="other engines serving a steady load while the slot is fitted (default 1: the "
        "embedded default's second rollout slot; 0: the slot alone)",
    )
    p.add_argument(
        "--workload-from",
        type=Path,
        default=None,
        help="a pearl run's log (RUN_DIR/rollout.jsonl): the workload defaults from it "
        "(without: the base profile's, copied)",
    )
    a = p.parse_args(argv)
    costs = measure(a.out, a.threads, a.loaded)
    fitted = a.out.read_text().splitlines()
    header = [  # the costs are measured here now, not copied
        line.replace("# costs and workload (copied", "# workload (copied")
        for line in fitted
        if line.startswith("#")
    ]
    profile = load_profile(str(a.out.resolve()))
    rounded = {k: round(v, 3) for k, v in costs.items()}
    profile = profile.model_copy(update={"costs": profile.costs.model_copy(update=rounded)})
    if a.workload_from is not None:
        seen = {k: round(v, 3) for k, v in workload_of(a.workload_from).items()}
        profile = profile.model_copy(update={"workload": profile.workload.model_validate(seen)})
        header = [h for h in header if not h.startswith("# workload (copied")]
        header = [h.removesuffix(",") + "." if h.endswith("placeholders),") else h for h in header]
        header.append(f"# MEASURED (workload): the means of the run log {a.workload_from.name}.")
    lines = [
        f"# Regenerate: {COMMAND}"
        + (" --workload-from RUN_DIR/rollout.jsonl" if a.workload_from else "")
        + " (benchmarks/fit_tiny_profile.py: the method).",
        "# The tiny Qwen3 (init_model, seed 0) on this CPU machine, GPU type 'cpu': a slot.",
        "# MEASURED HERE (costs): engine cold start, sleep, wake, stop (a reference engine,",
        f"# --threads {a.threads}); weight sync (export + reload); the reference trainer's",
        f"# update ({GROUPS} groups of 4, {PROMPT_TOKENS} + {OUTPUT_TOKENS} tokens), offload and"
        " onload. role_switch_s",
        "# and migrate_s: routing changes, 0.05 s."
        + (
            " The workload: `pearl run --steps 12` of the embedded\n# default, its"
            " RUN_DIR/rollout.jsonl given as --workload-from."
            if a.workload_from
            else ""
        ),
        f"# The slot fitted while {a.loaded} other engine(s) served a steady load."
        " The fit's own header follows.",
        *header,
    ]
    body = yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False)
    text = "\n".join(lines) + "\n\n" + body
    a.out.write_text(text)
    print(yaml.safe_dump({"costs": rounded}, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
