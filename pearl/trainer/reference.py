"""The reference trainer: GRPO with AReaL's decoupled loss on the torch model, AdamW, on
CPU. It implements ``pearl.trainer.protocol.Trainer``; ``docs/training.md`` says what it
computes.

One ``train_step`` is one committed update (the version goes up by one):

1. every trajectory of the batch becomes a sequence: its tokens, the loss mask (the tokens
   the model generated), the behaviour logprobs and versions. A trajectory that ended
   ``agent_error`` or ``turn_failed`` (``TrainerConfig.masked_end_reasons``; the rollout
   manager keeps them in their groups with reward 0, ``docs/agents.md``), or whose reward
   is not finite (a NaN in a batch file), is masked out of the loss, and its group's
   advantages are computed over the rest. Never scored either:
   the first token of a sequence (it has no context) and a token whose behaviour logprob
   is not finite (an engine's ``-inf``);
2. the group-normalised advantage of each trajectory (``loss.group_advantages``), the same
   for all of its tokens;
3. the sequences, shuffled by the trainer's seeded generator, are cut into
   ``minibatches`` minibatches (one optimizer step each), each into microbatches of at
   most ``max_tokens_per_microbatch`` padded tokens (gradients accumulate over them);
4. decoupled: the proximal logprobs are the weights at the start of the update, computed
   for every microbatch before the first optimizer step; with ``kl_coef`` the reference
   model's (the model directory's weights, frozen);
5. per minibatch: the loss of each microbatch (``loss.grpo_loss``, the token mean over
   the minibatch's loss tokens) backward, the gradient clipped to ``grad_clip``, AdamW.

Memory: ``offload`` writes the weights and the optimizer state to a file (on CPU there is
no other place to put them; ``offload_dir``) and frees them, and the heap is trimmed so
the process's RSS shows it; ``onload`` reads them back, bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

from pearl.agents.batches import RolloutBatch
from pearl.agents.loop import Trajectory
from pearl.engines.reference.config import CONFIG_FILE, GENERATION_CONFIG_FILE
from pearl.engines.reference.model import weight_shapes
from pearl.engines.reference.weights import write_weights
from pearl.io.documents import InputError
from pearl.trainer.checkpoint import (
    STATE_FILE,
    CheckpointState,
    atomic_dir,
    read_checkpoint,
    write_checkpoint,
)
from pearl.trainer.loss import LossParts, group_advantages, grpo_loss
from pearl.trainer.model import PolicyModel
from pearl.trainer.protocol import TrainMetrics

WEIGHTS_DIR = "v{:06d}"
OFFLOAD_FILE = "offload.safetensors"


class TrainerConfig(BaseModel):
    """The reference trainer's settings; the defaults fit the tiny model
    (``pearl model init``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(3e-3, gt=0, description="AdamW's learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's beta1, beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW's epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay.")
    grad_clip: float | None = Field(
        1.0, gt=0, description="Clip the gradient's global L2 norm to this; None: never."
    )
    eps_clip: float = Field(0.2, gt=0, description="PPO's clip: the ratio kept in 1 +- this.")
    eps_clip_high: float | None = Field(
        None, gt=0, description="The upper clip (1 + this), DAPO's clip-higher; None: eps_clip."
    )
    decoupled: bool = Field(
        True,
        description="AReaL's decoupled loss: the ratio against the proximal policy (the "
        "weights at the start of the update) times the capped behaviour importance weight; "
        "False: the ratio against the behaviour logprobs.",
    )
    behav_imp_weight_cap: float | None = Field(
        5.0,
        gt=1,
        description="Decoupled loss: tokens whose behaviour weight exp(proximal - behaviour) "
        "exceeds this are masked out of the loss; None: no cap.",
    )
    kl_coef: float = Field(
        0.0, ge=0, description="The weight of the k3 KL to the reference model; 0: none."
    )
    scale_advantages_by_std: bool = Field(
        True, description="Divide a group's centred rewards by its std (False: Dr. GRPO)."
    )
    advantage_eps: float = Field(1e-5, gt=0, description="Added to the group's std.")
    minibatches: int = Field(
        1, ge=1, description="Optimizer steps per update: the batch's sequences in this many parts."
    )
    max_tokens_per_microbatch: int = Field(
        4096,
        ge=1,
        description="Padded tokens (sequences x longest) per forward; gradients accumulate "
        "over a minibatch's microbatches. A longer sequence goes alone.",
    )
    masked_end_reasons: tuple[str, ...] = Field(
        ("agent_error", "turn_failed"),
        description="Trajectories that ended so are masked out of the loss and of their "
        "group's advantage.",
    )
    seed: int = Field(0, ge=0, description="Seeds the generator that shuffles minibatches.")
    threads: int | None = Field(
        None, ge=1, description="torch.set_num_threads (process-wide); None: torch's default."
    )
    offload_dir: Path | None = Field(
        None, description="Where offload writes the state; None: a new temporary directory."
    )


@dataclass
class _Seq:
    ids: torch.Tensor  # long [t]
    mask: torch.Tensor  # bool [t]: the tokens the loss counts
    behaviour: torch.Tensor  # float [t]
    versions: torch.Tensor  # long [t]: the policy version of each generated token
    advantage: float


@dataclass
class _Micro:
    ids: torch.Tensor  # [b, t], right-padded
    mask: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor  # [b, t]: each row its trajectory's advantage
    proximal: torch.Tensor | None = None
    reference: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


@dataclass
class _Sums:
    loss_tokens: int = 0
    kept: int = 0
    clipped: int = 0
    weight: float = 0.0
    kl: float = 0.0
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)

    def add(self, p: LossParts) -> None:
        self.loss_tokens += p.loss_tokens
        self.kept += p.kept_tokens
        self.clipped += p.clipped_tokens
        self.weight += p.weight_sum
        self.kl += p.kl_sum


def _trim_heap() -> None:
    """Hand freed memory back to the operating system, so an offload shows in the RSS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class ReferenceTrainer:
    """GRPO on the model in ``model_dir`` (a Hugging Face directory); see the module
    docstring."""

    def __init__(self, model_dir: str | Path, config: TrainerConfig | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.config = config or TrainerConfig()
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        self.model = PolicyModel.from_dir(self.model_dir)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.shapes = weight_shapes(self.model.cfg)
        c = self.config
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=c.lr,
            betas=c.betas,
            eps=c.adam_eps,
            weight_decay=c.weight_decay,
        )
        self._groups = self._param_groups()  # the optimizer's, kept while offloaded
        self.reference = self._reference_model() if c.kl_coef > 0 else None
        self.rng = torch.Generator().manual_seed(c.seed)
        self.step = 0  # committed updates
        self._version = 0  # the model directory's weights are version 0
        self._offloaded: Path | None = None  # the offload file while offloaded

    def _reference_model(self) -> PolicyModel:
        ref = PolicyModel.from_dir(self.model_dir)
        ref.requires_grad_(False)
        return ref

    @property
    def version(self) -> int:
        return self._version

    @property
    def offloaded(self) -> bool:
        return self._offloaded is not None

    # -- the update ------------------------------------------------------------------------

    def train_step(self, batch: RolloutBatch) -> TrainMetrics:
        self._require_onloaded("train_step")
        if batch.policy_version > self._version:
            raise ValueError(
                f"batch {batch.batch_id}: policy version {batch.policy_version} is ahead of "
                f"the trainer's weights (version {self._version})"
            )
        started = time.perf_counter()
        seqs, rewards = self._sequences(batch)
        layout = [[self._collate(m) for m in self._microbatches(mb)] for mb in self._split(seqs)]
        self._before_first_step(layout)
        sums = _Sums()
        for minibatch in layout:
            self._optimizer_step(minibatch, sums)
        self.optimizer.zero_grad(set_to_none=True)
        self._version += 1
        self.step += 1
        return self._metrics(batch, seqs, rewards, sums, time.perf_counter() - started)

    def _sequences(self, batch: RolloutBatch) -> tuple[list[_Seq], torch.Tensor]:
        """The batch's trainable sequences, and the rewards of the trajectories that count."""
        trajs = batch.trajectories
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        # masked: ended for a reason that says nothing of the policy, or nothing generated
        # (an episode its environment ended at reset): neither counts in its group
        masked = [
            t.end_reason in self.config.masked_end_reasons or not any(t.loss_mask) for t in trajs
        ]
        valid = ~torch.tensor(masked, dtype=torch.bool) & torch.isfinite(rewards)
        adv = group_advantages(
            rewards,
            torch.tensor(batch.group_ids, dtype=torch.long),
            valid,
            scale_by_std=self.config.scale_advantages_by_std,
            eps=self.config.advantage_eps,
        )
        seqs = []
        for t, ok, a in zip(trajs, valid.tolist(), adv.tolist(), strict=True):
            s = _sequence(t, a) if ok else None
            if s is not None:
                seqs.append(s)
        return seqs, rewards[valid]

    def _split(self, seqs: list[_Seq]) -> list[list[_Seq]]:
        order = torch.randperm(len(seqs), generator=self.rng).tolist()
        m = min(self.config.minibatches, len(seqs))
        bounds = [round(i * len(seqs) / max(m, 1)) for i in range(m + 1)]
        return [[seqs[i] for i in order[a:b]] for a, b in itertools.pairwise(bounds)]

    def _microbatches(self, seqs: list[_Seq]) -> list[list[_Seq]]:
        """Longest first, as many per microbatch as fit ``max_tokens_per_microbatch`` padded."""
        limit = self.config.max_tokens_per_microbatch
        out: list[list[_Seq]] = []
        for s in sorted(seqs, key=lambda s: -len(s.ids)):
            if out and (len(out[-1]) + 1) * len(out[-1][0].ids) <= limit:
                out[-1].append(s)
            else:
                out.append([s])
        return out

    @staticmethod
    def _collate(seqs: list[_Seq]) -> _Micro:
        n, t = len(seqs), max(len(s.ids) for s in seqs)
        m = _Micro(
            torch.zeros(n, t, dtype=torch.long),
            torch.zeros(n, t, dtype=torch.bool),
            torch.zeros(n, t),
            torch.zeros(n, t),
        )
        for i, s in enumerate(seqs):
            k = len(s.ids)
            m.ids[i, :k], m.mask[i, :k], m.behaviour[i, :k] = s.ids, s.mask, s.behaviour
            m.advantages[i, :] = s.advantage
        return m

    @torch.no_grad()
    def _before_first_step(self, layout: list[list[_Micro]]) -> None:
        for micro in (m for mb in layout for m in mb):
            if self.config.decoupled:
                micro.proximal = self.model.token_logprobs(micro.ids)
            if self.reference is not None:
                micro.reference = self.reference.token_logprobs(micro.ids)

    def _optimizer_step(self, minibatch: list[_Micro], sums: _Sums) -> None:
        tokens = sum(m.tokens for m in minibatch)
        if tokens == 0:
            return
        c = self.config
        self.optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for m in minibatch:
            parts = grpo_loss(
                self.model.token_logprobs(m.ids),
                m.behaviour,
                m.advantages,
                m.mask,
                num_tokens=tokens,
                eps_clip=c.eps_clip,
                eps_clip_high=c.eps_clip_high,
                proximal_logprobs=m.proximal,
                behav_imp_weight_cap=c.behav_imp_weight_cap,
                ref_logprobs=m.reference,
                kl_coef=c.kl_coef,
            )
            torch.autograd.backward(parts.loss)
            sums.add(parts)
            loss += float(parts.loss.detach())
        max_norm = c.grad_clip if c.grad_clip is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        sums.losses.append(loss)
        sums.norms.append(float(norm))

    def _metrics(
        self,
        batch: RolloutBatch,
        seqs: list[_Seq],
        rewards: torch.Tensor,
        sums: _Sums,
        time_s: float,
    ) -> TrainMetrics:
        old = batch.policy_version
        off_policy = sum(int((s.mask & (s.versions >= 0) & (s.versions < old)).sum()) for s in seqs)
        decoupled = self.config.decoupled
        return TrainMetrics(
            step=self.step - 1,
            version=self._version,
            loss=_mean(sums.losses),
            reward_mean=float(rewards.mean()) if len(rewards) else 0.0,
            reward_std=float(rewards.std(unbiased=False)) if len(rewards) else 0.0,
            kl=sums.kl / max(sums.loss_tokens, 1) if self.reference is not None else None,
            clip_fraction=sums.clipped / max(sums.loss_tokens, 1),
            importance_weight_mean=sums.weight / sums.kept if decoupled and sums.kept else 1.0,
            tokens=sum(int(s.mask.sum()) for s in seqs),
            off_policy_tokens=off_policy,
            grad_norm=_mean(sums.norms),
            time_s=time_s,
        )

    # -- weights for the engines -------------------------------------------------------------

    def export_weights(self, out_dir: Path) -> Path:
        self._require_onloaded("export_weights")
        target = Path(out_dir) / WEIGHTS_DIR.format(self._version)
        with atomic_dir(target) as d:
            write_weights(d, self.model.hf_state_dict(self.model.export_dtype()))
            self._copy_config(d)
        return target

    def _copy_config(self, d: Path) -> None:
        for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):
            if (self.model_dir / name).is_file():
                shutil.copyfile(self.model_dir / name, d / name)

    # -- memory ------------------------------------------------------------------------------

    def offload(self) -> None:
        if self._offloaded is not None:
            return
        folder = self.config.offload_dir or Path(tempfile.mkdtemp(prefix="pearl-offload-"))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / OFFLOAD_FILE
        weights = {f"param.{n}": p.detach() for n, p in self.model.named_parameters()}
        save_file(weights | self._optimizer_tensors(), path)
        self._groups = self._param_groups()
        for p in self.model.parameters():
            p.data = torch.empty(0)
            p.grad = None
        self.optimizer.state.clear()
        self.reference = None
        self._offloaded = path
        _trim_heap()

    def onload(self) -> None:
        if self._offloaded is None:
            return
        path, tensors = self._offloaded, load_file(self._offloaded)
        weights = {k[6:]: v for k, v in tensors.items() if k.startswith("param.")}
        self._set_weights(weights)
        self._set_optimizer({k: v for k, v in tensors.items() if not k.startswith("param.")})
        if self.config.kl_coef > 0:
            self.reference = self._reference_model()
        self._offloaded = None
        path.unlink(missing_ok=True)
        if self.config.offload_dir is None:
            shutil.rmtree(path.parent, ignore_errors=True)

    def _require_onloaded(self, what: str) -> None:
        if self._offloaded is not None:
            raise RuntimeError(f"{what}: the trainer is offloaded (onload first)")

    # -- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, path: Path) -> None:
        self._require_onloaded("save_checkpoint")
        state = CheckpointState(
            step=self.step,
            version=self._version,
            weights=self.model.hf_state_dict(),
            optimizer=self._optimizer_tensors(),
            rng={"shuffle": self.rng.get_state()},
            param_groups=self._param_groups(),
            config=self.config.model_dump(mode="json"),
        )
        write_checkpoint(Path(path), state, self.model_dir)

    def load_checkpoint(self, path: Path) -> None:
        path = Path(path)
        state = read_checkpoint(path)
        if sorted(state.weights) != sorted(self.names):
            raise InputError(path / STATE_FILE, "", "its weights are not this model's")
        self._groups = state.param_groups
        self._set_weights(state.weights)
        self._set_optimizer(state.optimizer)
        if "shuffle" in state.rng:
            self.rng.set_state(state.rng["shuffle"])
        self.step, self._version = state.step, state.version
        if self._offloaded is not None:  # the checkpoint replaces the offloaded state
            self._offloaded.unlink(missing_ok=True)
            self._offloaded = None
        if self.config.kl_coef > 0 and self.reference is None:
            self.reference = self._reference_model()

    # -- state as tensors ------------------------------------------------------------------

    def _param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's hyperparameters, each group's params as names."""
        groups = self.optimizer.state_dict()["param_groups"]
        return [{**g, "params": [self.names[i] for i in g["params"]]} for g in groups]

    def _optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer's per-parameter state: ``<param name>.<key>`` (AdamW: ``step``,
        ``exp_avg``, ``exp_avg_sq``)."""
        out: dict[str, torch.Tensor] = {}
        for i, per_param in self.optimizer.state_dict()["state"].items():
            for key, value in per_param.items():
                out[f"{self.names[i]}.{key}"] = torch.as_tensor(value).detach().clone()
        return out

    def _set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        for name in params:
            if tuple(weights[name].shape) != self.shapes[name]:
                raise ValueError(f"{name}: shape {tuple(weights[name].shape)}, not the model's")
        for name, p in params.items():  # copies: never views of a (mapped) file
            p.data = weights[name].to(torch.float32, copy=True).contiguous()

    def _set_optimizer(self, tensors: dict[str, torch.Tensor]) -> None:
        index = {n: i for i, n in enumerate(self.names)}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            name, _, what = key.rpartition(".")
            if name not in index:
                raise ValueError(f"optimizer state for {name!r}, not a parameter of the model")
            state.setdefault(index[name], {})[what] = value.clone()
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in self._groups]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _sequence(t: Trajectory, advantage: float) -> _Seq | None:
    """The trajectory's tokens with what its loss counts; None when it counts nothing."""
    if len(t.token_ids) < 2:
        return None
    behaviour = torch.tensor(t.logprobs, dtype=torch.float32)
    mask = torch.tensor(t.loss_mask, dtype=torch.bool) & torch.isfinite(behaviour)
    mask[0] = False
    if not mask.any():
        return None
    behaviour = torch.where(mask, behaviour, torch.zeros_like(behaviour))
    ids = torch.tensor(t.token_ids, dtype=torch.long)
    return _Seq(ids, mask, behaviour, torch.tensor(t.versions, dtype=torch.long), advantage)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
