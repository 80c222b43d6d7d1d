"""The trainer against one real reference engine: the behaviour logprobs of a sequence the
engine generated (temperature 1) are the trainer's model's; after an update is published
the engine's tokens carry the new version and their logprobs are the updated model's; an
engine that cannot reload is reported by name while the others reload."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from engine_procs import EngineProc, start_engine, wait_healthy  # noqa: E402
from rollouts import make_batch  # noqa: E402

from pearl.control.workers import free_port  # noqa: E402
from pearl.engines.client import EngineClient  # noqa: E402
from pearl.trainer.model import PolicyModel  # noqa: E402
from pearl.trainer.publish import WeightPublisher  # noqa: E402
from pearl.trainer.reference import ReferenceTrainer  # noqa: E402

TOL = 1e-4
PROMPT = [17, 204, 33, 98, 401, 7, 250, 61]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProc]:
    proc = start_engine(tiny_model_dir, tmp_path_factory.mktemp("trainer-engine"), "t0")
    try:
        wait_healthy([proc])
        yield proc
    finally:
        proc.stop()


async def _generate(url: str, seed: int) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": seed,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
    }
    async with EngineClient(url) as c:
        choice: dict[str, Any] = (await c.completions(body))["choices"][0]
    return choice


def _model_logprobs(model: PolicyModel, output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        lp = model.token_logprobs(torch.tensor([PROMPT + output]))[0]
    return lp[len(PROMPT) :]


def _engine_logprobs(choice: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(choice["logprobs"]["token_logprobs"])


def test_the_engines_behaviour_logprobs_are_the_models(
    engine: EngineProc, tiny_model_dir: Path
) -> None:
    async def main() -> dict[str, Any]:
        async with EngineClient(engine.url) as c:
            await c.reload_weights()  # its own directory's weights, whatever ran before
        return await _generate(engine.url, seed=3)

    choice = asyncio.run(main())
    output = list(choice["token_ids"])
    assert len(output) == 16
    model = PolicyModel.from_dir(tiny_model_dir)
    assert (_model_logprobs(model, output) - _engine_logprobs(choice)).abs().max() < TOL


def test_published_weights_reach_the_engine(
    engine: EngineProc, tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = ReferenceTrainer(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (6,), generator=gen).tolist() for _ in range(2)]
    for k in range(2):
        batch = make_batch(
            trainer.model, k, trainer.version, prompts=prompts, group=4, new_tokens=8,
            subset=frozenset(range(3, 100)), gen=gen,
        )  # fmt: skip
        trainer.train_step(batch)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    publisher = WeightPublisher(
        tmp_path / "weights", lambda: {"t0": engine.url, "gone": dead}, timeout_s=10
    )

    async def main() -> tuple[Any, dict[str, Any]]:
        result = await publisher.publish(trainer)
        return result, await _generate(engine.url, seed=4)

    result, choice = asyncio.run(main())
    assert result.version == 2 and result.weights_dir == tmp_path / "weights" / "v000002"
    assert result.reloaded == ("t0",)
    (failure,) = result.failed
    assert (failure.name, failure.url) == ("gone", dead) and "unreachable" in failure.error
    assert result.export_s > 0 and result.reload_s > 0 and result.duration_s < 30
    assert choice["weight_versions"] == [2] * 16
    output = list(choice["token_ids"])
    engine_lp = _engine_logprobs(choice)
    assert (_model_logprobs(trainer.model, output) - engine_lp).abs().max() < TOL
    before = PolicyModel.from_dir(tiny_model_dir)  # the update did change them
    assert (_model_logprobs(before, output) - engine_lp).abs().max() > 1e-2


def test_a_sleeping_engine_is_skipped_and_the_reloaded_are_told(
    engine: EngineProc, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An engine asleep (a sleep step under way: its weights are off the GPU, in vLLM) is
    not reloaded, nor counted failed; it loads the latest as it wakes. Each engine that
    reloaded is reported (the router's table notes the version its tokens carry)."""
    trainer = ReferenceTrainer(tiny_model_dir)
    told: list[tuple[str, int]] = []
    publisher = WeightPublisher(
        tmp_path / "weights",
        lambda: {"t0": engine.url},
        timeout_s=10,
        loaded=lambda name, version: told.append((name, version)),
    )

    async def main() -> tuple[Any, Any]:
        async with EngineClient(engine.url) as c:
            await c.sleep(1)
            try:
                asleep = await publisher.publish(trainer)
            finally:
                await c.wake_up()
        return asleep, await publisher.publish(trainer)

    asleep, awake = asyncio.run(main())
    assert (asleep.reloaded, asleep.failed) == ((), ())
    assert awake.reloaded == ("t0",) and told == [("t0", trainer.version)]
