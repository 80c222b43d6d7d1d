"""The trainer in a process of its own (``pearl trainer serve``, ``RemoteTrainer``): the
same updates, bit for bit, as the trainer in this process; offload frees the server's
memory and onload restores it; checkpoints and exports land where asked; a bad request is
400 with a JSON error and changes nothing; a killed server is ``TrainerLost``, and a
restarted one resumes from the checkpoint."""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")

from engine_procs import rss_bytes  # noqa: E402
from rollouts import make_batch  # noqa: E402

from pearl.agents.batches import RolloutBatch  # noqa: E402
from pearl.engines.reference.tiny import init_model  # noqa: E402
from pearl.io.documents import InputError  # noqa: E402
from pearl.trainer.checkpoint import CheckpointDir  # noqa: E402
from pearl.trainer.model import PolicyModel  # noqa: E402
from pearl.trainer.reference import ReferenceTrainer, TrainerConfig  # noqa: E402
from pearl.trainer.remote import (  # noqa: E402
    RemoteTrainer,
    TrainerError,
    TrainerLost,
    TrainerProcess,
    metrics_of,
)

CONFIG = TrainerConfig(minibatches=2, max_tokens_per_microbatch=24, seed=5, threads=1)


def _batch(model: object, batch_id: int, version: int, seed: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 500, (5,), generator=gen).tolist() for _ in range(2)]
    return make_batch(
        model, batch_id, version, prompts=prompts, group=4, new_tokens=6,
        subset=frozenset(range(3, 120)), gen=torch.Generator().manual_seed(seed),
    )  # fmt: skip


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[TrainerProcess, RemoteTrainer]]:
    proc = TrainerProcess(tiny_model_dir, CONFIG, tmp_path / "logs").start()
    remote = RemoteTrainer(proc.url)
    try:
        yield proc, remote
    finally:
        remote.close()
        proc.stop()


def test_the_served_trainer_updates_as_the_local_one(
    served: tuple[TrainerProcess, RemoteTrainer], tiny_model_dir: Path, tmp_path: Path
) -> None:
    _, remote = served
    local = ReferenceTrainer(tiny_model_dir, CONFIG)
    for k in range(2):
        batch = _batch(local.model, k, local.version, seed=k)
        want, got = local.train_step(batch), remote.train_step(batch)
        assert (got.step, got.version, got.tokens) == (want.step, want.version, want.tokens)
        assert got.loss == want.loss and got.grad_norm == want.grad_norm
    assert remote.version == local.version == 2
    exported = remote.export_weights(tmp_path / "weights")
    assert exported == tmp_path / "weights" / "v000002"
    ours = local.export_weights(tmp_path / "ours")
    assert (exported / "model.safetensors").read_bytes() == (
        ours / "model.safetensors"
    ).read_bytes()


def test_offload_frees_the_servers_memory_and_onload_restores_it(tmp_path: Path) -> None:
    wide = init_model(tmp_path / "wide", hidden=512, heads=8, kv_heads=4, intermediate=1536)
    model = PolicyModel.from_dir(wide)
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    assert state_bytes > 70e6  # the weights and AdamW's two moments
    proc = TrainerProcess(wide, CONFIG, tmp_path / "logs").start()
    remote = RemoteTrainer(proc.url)
    try:
        assert proc.pid is not None
        remote.train_step(_batch(model, 0, 0, seed=0))  # the optimizer's state exists
        before = remote.export_weights(tmp_path / "before")
        rss = rss_bytes(proc.pid)
        remote.offload()
        freed = rss - rss_bytes(proc.pid)
        assert remote.offloaded and remote.refresh()["offloaded"] is True
        assert freed > 0.7 * state_bytes, f"{freed / 1e6:.0f} MB of {state_bytes / 1e6:.0f} MB"
        with pytest.raises(TrainerError, match=r"500.*offloaded"):
            remote.train_step(_batch(model, 1, 1, seed=1))
        remote.onload()
        assert not remote.offloaded
        after = remote.export_weights(tmp_path / "after")
        assert (after / "model.safetensors").read_bytes() == (
            before / "model.safetensors"
        ).read_bytes()
        assert remote.train_step(_batch(model, 1, 1, seed=1)).version == 2
    finally:
        remote.close()
        proc.stop()


def test_a_bad_request_is_400_with_a_json_error_and_changes_nothing(
    served: tuple[TrainerProcess, RemoteTrainer], tmp_path: Path
) -> None:
    proc, remote = served
    r = httpx.post(f"{proc.url}/train_step", content=b'{"batch_id": 0}')
    assert r.status_code == 400, r.text
    assert "field" in r.json()["error"]["message"]
    r = httpx.post(f"{proc.url}/load_checkpoint", json={"path": str(tmp_path / "none")})
    assert r.status_code == 400 and "no such checkpoint" in r.json()["error"]["message"]
    r = httpx.post(f"{proc.url}/save_checkpoint", json={"where": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    with pytest.raises(InputError, match="none: path: no such checkpoint directory"):
        remote.load_checkpoint(tmp_path / "none")  # a 400 is relayed as the input's error
    assert remote.refresh()["version"] == 0


def test_a_killed_server_is_lost_and_a_restarted_one_resumes_from_the_checkpoint(
    served: tuple[TrainerProcess, RemoteTrainer], tiny_model_dir: Path, tmp_path: Path
) -> None:
    proc, remote = served
    local = ReferenceTrainer(tiny_model_dir, CONFIG)
    batch = _batch(local.model, 0, 0, seed=0)
    remote.train_step(batch)
    checkpoints = CheckpointDir(tmp_path / "checkpoints")
    remote.save_checkpoint(checkpoints.path(1))
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.proc.wait()  # type: ignore[union-attr]
    with pytest.raises(TrainerLost):
        remote.train_step(_batch(local.model, 1, 1, seed=1))
    proc.restart()
    assert proc.restarts == 1 and remote.refresh()["version"] == 0
    remote.load_checkpoint(checkpoints.path(1))
    assert remote.version == 1
    local.train_step(batch)
    second = _batch(local.model, 1, 1, seed=1)
    assert remote.train_step(second).loss == local.train_step(second).loss


def test_metrics_from_the_wire_keep_nan_and_name_a_bad_field() -> None:
    good = {
        "step": 0, "version": 1, "loss": float("nan"), "reward_mean": 0.5, "reward_std": 0.1,
        "kl": None, "clip_fraction": 0.0, "importance_weight_mean": 1.0, "tokens": 7,
        "off_policy_tokens": 0, "grad_norm": float("inf"), "time_s": 0.2,
    }  # fmt: skip
    metrics = metrics_of(json.loads(json.dumps(good, allow_nan=True)))  # as the server writes
    assert math.isnan(metrics.loss) and math.isinf(metrics.grad_norm) and metrics.kl is None
    with pytest.raises(TrainerError, match="field 'tokens'"):
        metrics_of(good | {"tokens": "many"})


def test_the_megatron_trainers_process_is_its_backend_with_its_options(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``trainer.backend: megatron`` renders ``pearl trainer serve --backend megatron
    --megatron FILE`` with the options; on a machine without CUDA (this one) the command
    refuses in one line (exit 2), naming what it needs."""
    import subprocess

    from pearl.trainer.megatron.config import MegatronOptions

    options = MegatronOptions(compute_dtype="float32", seed=3)
    proc = TrainerProcess(tiny_model_dir, CONFIG, tmp_path / "logs", "megatron", options)
    flag = proc.argv.index("--backend")
    assert proc.argv[flag : flag + 2] == ["--backend", "megatron"]
    options_file = Path(proc.argv[proc.argv.index("--megatron") + 1])
    assert MegatronOptions.model_validate_json(options_file.read_text()) == options
    assert "--backend" not in TrainerProcess(tiny_model_dir, CONFIG, tmp_path / "r").argv
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the refusal is for machines without one")
    done = subprocess.run(proc.argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--backend megatron" in done.stderr and (
        "needs CUDA" in done.stderr or "not installed" in done.stderr
    ), done.stderr
