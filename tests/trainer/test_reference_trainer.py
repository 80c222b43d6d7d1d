"""The reference trainer on batches sampled from its own model: checkpoints round-trip bit
for bit and are atomic, offload frees the memory (RSS) and onload restores it bit for
bit, masked trajectories and observation tokens never count, exported weights are the
engine's names in the config's dtype, off-policy tokens are counted and weighted."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from engine_procs import rss_bytes  # noqa: E402
from rollouts import batch_of, make_batch, trajectory  # noqa: E402

from pearl.agents.batches import RolloutBatch  # noqa: E402
from pearl.engines.reference.model import weight_shapes  # noqa: E402
from pearl.engines.reference.tiny import init_model  # noqa: E402
from pearl.engines.reference.weights import read_weights  # noqa: E402
from pearl.io.documents import InputError  # noqa: E402
from pearl.trainer import checkpoint  # noqa: E402
from pearl.trainer.checkpoint import CheckpointDir  # noqa: E402
from pearl.trainer.reference import ReferenceTrainer, TrainerConfig  # noqa: E402

GROUP, NEW_TOKENS = 4, 6
SUBSET = frozenset(range(3, 120))


def _prompts(seed: int = 0, n: int = 2) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (5,), generator=gen).tolist() for _ in range(n)]


def _batch(trainer: ReferenceTrainer, batch_id: int, seed: int) -> RolloutBatch:
    v = trainer.version
    return make_batch(
        trainer.model, batch_id, v, prompts=_prompts(seed), group=GROUP,
        new_tokens=NEW_TOKENS, subset=SUBSET, gen=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def _state(t: ReferenceTrainer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for n, p in t.model.named_parameters()}
    out |= {f"o.{k}": v for k, v in t._optimizer_tensors().items()}
    return out | {"rng": t.rng.get_state()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


CONFIG = TrainerConfig(minibatches=2, max_tokens_per_microbatch=24, seed=5)


def test_checkpoint_round_trip_is_bit_equal_and_training_goes_on_alike(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    a = ReferenceTrainer(tiny_model_dir, CONFIG)
    for k in range(2):
        a.train_step(_batch(a, k, seed=k))
    a.save_checkpoint(tmp_path / "ck")
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors",
                     "optimizer.safetensors", "trainer.json"]  # fmt: skip
    doc = json.loads((tmp_path / "ck" / "trainer.json").read_text())
    assert (doc["step"], doc["version"]) == (2, 2)
    assert doc["param_groups"][0]["params"][0] == "model.embed_tokens.weight"
    assert set(read_weights_file(tmp_path / "ck" / "model.safetensors")) == set(a.names)

    b = ReferenceTrainer(tiny_model_dir, CONFIG)
    b.load_checkpoint(tmp_path / "ck")
    assert (b.step, b.version) == (2, 2) and _equal(_state(a), _state(b))
    batch = _batch(a, 2, seed=9)
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert replace(ma, time_s=mb.time_s) == mb and ma.step == 2
    assert _equal(_state(a), _state(b))


def read_weights_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def test_a_half_written_checkpoint_is_never_the_latest(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpts = CheckpointDir(tmp_path / "checkpoints", keep=2)
    t = ReferenceTrainer(tiny_model_dir)
    t.save_checkpoint(ckpts.path(0))
    t.train_step(_batch(t, 0, seed=0))
    t.save_checkpoint(ckpts.path(1))
    # a trainer killed while writing step 2 leaves its staging directory
    dead = ckpts.root / ".step-000002.tmp-4242-0badcafe"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half")
    assert ckpts.latest() == (1, ckpts.path(1))
    # a save that fails part way leaves nothing
    original = checkpoint.save_file
    calls = []

    def fail_second(*args: Any, **kwargs: Any) -> None:
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("disk full")
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", fail_second)
    with pytest.raises(OSError, match="disk full"):
        t.save_checkpoint(ckpts.path(2))
    monkeypatch.undo()
    assert ckpts.steps() == [0, 1] and not ckpts.path(2).exists()
    assert sorted(p.name for p in ckpts.root.iterdir()) == [dead.name, "step-000000", "step-000001"]
    # the next save and its prune clear the leftovers and the oldest
    t.save_checkpoint(ckpts.path(2))
    ckpts.prune()
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["step-000001", "step-000002"]
    (ckpts.path(2) / "trainer.json").write_text('{"format": "other"}')
    with pytest.raises(InputError, match=r"trainer\.json: format"):
        ReferenceTrainer(tiny_model_dir).load_checkpoint(ckpts.path(2))


def test_offload_frees_the_memory_and_onload_restores_it_bit_for_bit(tmp_path: Path) -> None:
    model_dir = init_model(
        tmp_path / "wide", hidden=512, heads=8, kv_heads=4, intermediate=1536, layers=2
    )
    t = ReferenceTrainer(model_dir, TrainerConfig(offload_dir=tmp_path / "offload"))
    t.train_step(_batch(t, 0, seed=0))
    later = _batch(t, 1, seed=1)
    before = _state(t)
    state_bytes = sum(v.numel() * v.element_size() for v in before.values())
    assert state_bytes > 70e6  # weights and AdamW's two moments
    rss = rss_bytes_self()
    t.offload()
    freed = rss - rss_bytes_self()
    assert freed > 0.7 * state_bytes, f"{freed / 1e6:.0f} MB of {state_bytes / 1e6:.0f} MB"
    assert (tmp_path / "offload" / "offload.safetensors").is_file()
    with pytest.raises(RuntimeError, match="offloaded"):
        t.train_step(later)
    t.onload()
    assert _equal(before, _state(t)) and not (tmp_path / "offload" / "offload.safetensors").exists()
    t.train_step(later)


def rss_bytes_self() -> int:
    return rss_bytes(os.getpid())


def test_masked_trajectories_and_observations_never_count(tiny_model_dir: Path) -> None:
    """A group of four: one ``agent_error`` (reward 9, as if it had scored) and one
    ``turn_failed``; the update equals the one on the batch without them. Observation
    tokens inside a trajectory are not loss tokens."""
    t = ReferenceTrainer(tiny_model_dir)
    twin = ReferenceTrainer(tiny_model_dir)
    base = _batch(t, 0, seed=3)
    trajs = list(base.trajectories)
    ids, lps = trajs[0].token_ids, trajs[0].logprobs
    obs = trajectory("obs", ids[:5], ids[5:8], lps[5:8], 0, 1.0)
    obs.append([7, 8, 9], generated=False)  # a tool's observation between two turns
    obs.append(ids[8:], generated=True, logprobs=lps[8:], versions=[0] * 3)
    keep = [obs, trajs[1], *trajs[4:]]  # group 0: obs and trajs[1]; group 1 whole
    error = trajectory("err", [1, 2], [3, 4], [-1.0, -1.0], 0, 9.0, end_reason="agent_error")
    failed = trajectory("fail", [1, 2], [5], [-1.0], 0, 0.0, end_reason="turn_failed")
    masked = batch_of(0, 0, [*keep[:2], error, failed, *keep[2:]], GROUP)
    clean = RolloutBatch(0, 0, tuple(keep), (0, 0, 1, 1, 1, 1), 0, 0, 0.0)
    m, m_twin = t.train_step(masked), twin.train_step(clean)
    loss_tokens = sum(sum(x.loss_mask) for x in keep)
    assert m.tokens == m_twin.tokens == loss_tokens == 6 * NEW_TOKENS
    assert m.reward_mean == pytest.approx(m_twin.reward_mean)
    a, b = t.model.hf_state_dict(), twin.model.hf_state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_a_batch_with_nothing_to_train_still_commits_an_update(tiny_model_dir: Path) -> None:
    """Every trajectory masked (errors, a NaN reward): no loss tokens, no change to the
    weights, the version goes on."""
    t = ReferenceTrainer(tiny_model_dir)
    before = t.model.hf_state_dict()
    trajs = [
        trajectory("err", [1, 2], [3, 4], [-1.0, -1.0], 0, 9.0, end_reason="agent_error"),
        trajectory("nan", [1, 2], [5, 6], [-1.0, -1.0], 0, float("nan")),
    ]
    m = t.train_step(batch_of(0, 0, trajs, 2))
    assert (m.version, m.tokens, m.loss, m.grad_norm, m.reward_mean) == (1, 0, 0.0, 0.0, 0.0)
    assert t.train_step(RolloutBatch(1, 1, (), (), 0, 0, 0.0)).version == 2  # empty
    assert all(torch.equal(before[k], v) for k, v in t.model.hf_state_dict().items())


def test_off_policy_tokens_are_counted_and_weighted(tiny_model_dir: Path) -> None:
    t = ReferenceTrainer(tiny_model_dir)
    stale = _batch(t, 0, seed=0)  # sampled by version 0
    m0 = t.train_step(stale)
    assert (m0.off_policy_tokens, m0.clip_fraction) == (0, 0.0)
    assert m0.importance_weight_mean == pytest.approx(1.0, abs=1e-5)  # sampled by these weights
    again = RolloutBatch(1, 1, stale.trajectories, stale.group_ids, 0, 1, 1.0)
    m1 = t.train_step(again)  # version 1 trains tokens of version 0
    assert m1.off_policy_tokens == m1.tokens == 2 * GROUP * NEW_TOKENS
    assert m1.importance_weight_mean != 1.0 and (m1.step, m1.version) == (1, 2)
    with pytest.raises(ValueError, match="ahead of the trainer"):
        t.train_step(RolloutBatch(2, 5, stale.trajectories, stale.group_ids, 0, 0, 0.0))


def test_kl_to_the_reference_model(tiny_model_dir: Path) -> None:
    t = ReferenceTrainer(tiny_model_dir, TrainerConfig(kl_coef=0.1))
    first = t.train_step(_batch(t, 0, seed=0))
    assert first.kl == pytest.approx(0.0, abs=1e-7)  # the policy is the reference yet
    second = t.train_step(_batch(t, 1, seed=1))
    assert second.kl is not None and second.kl > 0
    plain = ReferenceTrainer(tiny_model_dir)
    assert plain.train_step(_batch(plain, 0, seed=0)).kl is None


def test_exported_weights_are_the_engines(tiny_model_dir: Path, tmp_path: Path) -> None:
    t = ReferenceTrainer(tiny_model_dir)
    t.train_step(_batch(t, 0, seed=0))
    out = t.export_weights(tmp_path / "weights")
    assert out == tmp_path / "weights" / "v000001"
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000001"]
    assert {p.name for p in out.iterdir()} == {
        "model.safetensors", "config.json", "generation_config.json"
    }  # fmt: skip
    w = read_weights(out)
    assert {k: tuple(v.shape) for k, v in w.items()} == weight_shapes(t.model.cfg)
    assert all(v.dtype == torch.float32 for v in w.values())
    assert all(torch.equal(w[n], p.detach()) for n, p in t.model.named_parameters())
