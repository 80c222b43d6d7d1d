"""The Megatron section of ``scripts/device-check``: a few GRPO steps of ``MegatronTrainer`` on
one GPU, the export reloaded into a running engine, and the engine's logprobs against the
trainer's. Prints one JSON object; exit status 0 when it passed, 1 when not.

    python -m pearl.trainer.megatron.device_check --model DIR --engine-url URL --out DIR

1. the engine (serving DIR's weights, version 0) answers a greedy completion of a fixed
   prompt with the logprob of each token (``seq0``); the trainer, built from DIR, computes
   its own for the same tokens: ``gap_before`` (the HF -> Megatron mapping);
2. ``groups`` groups of ``group_size`` sampled completions from the engine are a
   ``RolloutBatch`` (reward: the share of even token ids, so that advantages are not all
   zero); ``steps`` ``train_step`` calls on it: the reference trainer's loss and update
   (``pearl.trainer.grpo``, ``TrainerConfig`` defaults but ``lr``: decoupled, the proximal
   logprobs recomputed at the start of each update), each step's ``TrainMetrics`` in
   ``steps``, every loss and gradient norm finite;
3. ``export_weights`` and ``reload_weights(weights_path=EXPORT)`` on the engine;
4. the engine's greedy completion of the same prompt again (``seq1``): it must have moved
   (other tokens, or logprobs off by more than the tolerance), and equal the trainer's
   logprobs of ``seq1`` within the tolerance: ``gap_after`` (the Megatron -> HF export);
5. the engine reloads DIR, so that later checks see the weights they started with.

The tolerance covers the engine computing in another precision (vLLM serves a float32
checkpoint in bfloat16 unless told otherwise); the trainer's logprobs here are float32.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import traceback
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pearl.agents.batches import RolloutBatch
from pearl.agents.loop import Trajectory
from pearl.engines.client import EngineClient

PROMPT = [11, 42, 7, 99, 5, 300, 17, 64]  # token ids below the device check's vocabulary (2048)
MAX_TOKENS = 12


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pearl.trainer.megatron.device_check")
    p.add_argument("--model", required=True, type=Path, help="the model directory engines serve")
    p.add_argument("--engine-url", required=True, help="a running engine serving --model")
    p.add_argument("--served-model", default="tiny", help="the engine's model name")
    p.add_argument("--out", required=True, type=Path, help="where exports are written")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--spec", default="auto", choices=["auto", "local", "te"])
    p.add_argument("--tolerance", type=float, default=0.1, help="max |logprob difference|")
    p.add_argument("--timeout-s", type=float, default=120.0, help="each engine request's")
    p.add_argument("--device", default="cuda", help="the trainer's torch device")
    return p


async def _complete(
    c: EngineClient, model: str, prompt: list[int], *, greedy: bool, seed: int
) -> tuple[list[int], list[float]]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0 if greedy else 1.0,
        "seed": seed,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
    }
    choice = (await c.completions(body))["choices"][0]
    return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]


def _gap(engine: list[float], trainer: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(engine, trainer, strict=True))


async def _sampled_batch(c: EngineClient, model: str, groups: int, group_size: int) -> RolloutBatch:
    trajectories, group_ids = [], []
    for g in range(groups):
        prompt = [(t + 13 * g) % 1024 for t in PROMPT]
        for k in range(group_size):
            ids, lps = await _complete(c, model, prompt, greedy=False, seed=100 * g + k)
            traj = Trajectory(traj_id=f"g{g}-{k}")
            traj.append(prompt, generated=False)
            traj.append(ids, generated=True, logprobs=lps, versions=[0] * len(ids))
            traj.reward = sum(1 for t in ids if t % 2 == 0) / len(ids)
            trajectories.append(traj)
            group_ids.append(g)
    return RolloutBatch(
        batch_id=0,
        policy_version=0,
        trajectories=tuple(trajectories),
        group_ids=tuple(group_ids),
        off_policy_tokens=0,
        max_staleness_versions=0,
        mean_staleness_versions=0.0,
    )


@dataclass(frozen=True)
class Check:
    model: Path  # the model directory the engine serves
    engine_url: str
    served_model: str
    out: Path  # where exports go
    steps: int
    groups: int
    group_size: int
    lr: float
    spec: str
    tolerance: float  # max |logprob difference|, engine against trainer
    timeout_s: float  # each engine request's
    device: str  # the trainer's ("cuda"; Megatron's forward does not run on CPU)


async def run(args: Check, report: dict[str, Any]) -> None:
    """Fill ``report`` as the steps go (so that a failure shows how far it got)."""
    import megatron.core
    import torch

    from pearl.trainer.config import TrainerConfig
    from pearl.trainer.megatron.config import parse_options
    from pearl.trainer.megatron.trainer import MegatronTrainer

    config = TrainerConfig(lr=args.lr)  # the reference trainer's loss and AdamW otherwise
    options = parse_options({"spec": args.spec, "compute_dtype": "float32"})
    report |= {"megatron_core": megatron.core.__version__, "torch": torch.__version__}
    device = torch.device(args.device)
    trainer = MegatronTrainer.start(args.model, config, options, device=device)
    report["spec"] = trainer.spec
    n = len(PROMPT)
    async with EngineClient(args.engine_url, timeout_s=args.timeout_s) as c:
        seq0, engine0 = await _complete(c, args.served_model, PROMPT, greedy=True, seed=0)
        report["gap_before"] = _gap(engine0, trainer.logprobs(PROMPT + seq0)[n - 1 :])
        batch = await _sampled_batch(c, args.served_model, args.groups, args.group_size)
        report["steps"] = [asdict(trainer.train_step(batch)) for _ in range(args.steps)]
        export = trainer.export_weights(args.out)
        report["export"] = str(export)
        try:
            report["reload"] = await c.reload_weights(weights_path=str(export))
            seq1, engine1 = await _complete(c, args.served_model, PROMPT, greedy=True, seed=0)
            report["gap_after"] = _gap(engine1, trainer.logprobs(PROMPT + seq1)[n - 1 :])
            report["moved"] = seq1 != seq0 or _gap(engine1, engine0) > args.tolerance
        finally:
            await c.reload_weights(weights_path=str(args.model))
    finite = all(math.isfinite(m[k]) for m in report["steps"] for k in ("loss", "grad_norm"))
    report["finite"] = finite
    report["passed"] = bool(
        finite
        and report["gap_before"] <= args.tolerance
        and report["gap_after"] <= args.tolerance
        and report["moved"]
    )


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    check = Check(**{f.name: getattr(a, f.name) for f in fields(Check)})  # the flags' names
    report: dict[str, Any] = {"check": {k: str(v) for k, v in asdict(check).items()}}
    try:
        asyncio.run(run(check, report))
    except Exception as err:  # the report says what failed; the traceback goes to stderr
        traceback.print_exc()
        report |= {"error": f"{type(err).__name__}: {err}", "passed": False}
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
