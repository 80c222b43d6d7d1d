"""What every trainer backend does the same: ``GrpoTrainer``, the part of a
``pearl.trainer.protocol.Trainer`` that is not its model.

A backend (``ReferenceTrainer``: ``PolicyModel`` on CPU; ``MegatronTrainer``: Megatron-core's
``GPTModel`` on a GPU) gives the model call and the weights in and out under Hugging Face
names (the abstract methods below) and its own ``offload``/``onload``; the rest is here,
once:

- ``train_step``: the batch laid out (``pearl.trainer.batching.layout``: sequences, masks,
  behaviour logprobs, advantages, minibatches, microbatches), moved to the backend's
  device; decoupled, the proximal logprobs of every microbatch with the weights at the
  start of the update (and with ``kl_coef`` the reference model's), before the first
  optimizer step; per minibatch the loss of each microbatch (``pearl.trainer.loss.
  grpo_loss``, the token mean over the minibatch's loss tokens) backward, the gradient's
  global L2 norm clipped to ``grad_clip``, one AdamW step; the ``LossParts`` summed into
  ``TrainMetrics``;
- ``export_weights``: ``out_dir/v{version:06d}/`` with ``model.safetensors`` (Hugging Face
  names, the config's ``torch_dtype``), ``config.json`` and ``generation_config.json``,
  written whole (``checkpoint.atomic_dir``);
- ``save_checkpoint``/``load_checkpoint``: the checkpoint directory of
  ``pearl.trainer.checkpoint`` (weights under Hugging Face names, float32; the optimizer's
  per-parameter state under the names of the backend's parameters; step, version, the
  shuffle generator).

``docs/training.md`` writes the loss out; ``docs/megatron.md`` says what of the Megatron
backend is checked on CPU.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pearl.agents.batches import RolloutBatch, vocabulary_problem
from pearl.engines.reference.config import ModelConfig
from pearl.engines.reference.model import DTYPES, weight_shapes
from pearl.engines.reference.weights import write_weights
from pearl.io.documents import InputError
from pearl.trainer.batching import Layout, Microbatch, layout
from pearl.trainer.checkpoint import (
    STATE_FILE,
    CheckpointState,
    atomic_dir,
    copy_model_config,
    read_checkpoint,
    write_checkpoint,
)
from pearl.trainer.config import TrainerConfig
from pearl.trainer.loss import LossParts, grpo_loss
from pearl.trainer.protocol import Trainer, TrainMetrics

WEIGHTS_DIR = "v{:06d}"  # export_weights' directory under out_dir


def adamw(parameters: list[torch.nn.Parameter], config: TrainerConfig) -> torch.optim.AdamW:
    """The optimizer every backend steps (torch's AdamW, float32 state)."""
    return torch.optim.AdamW(
        parameters,
        lr=config.lr,
        betas=config.betas,
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )


@dataclass
class LossSums:
    """One update's ``LossParts`` summed, and each optimizer step's loss and gradient norm."""

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


def train_metrics(
    lay: Layout,
    sums: LossSums,
    config: TrainerConfig,
    *,
    step: int,
    version: int,
    time_s: float,
) -> TrainMetrics:
    """The update's ``TrainMetrics`` (``docs/training.md``, "What is measured")."""
    rewards = lay.rewards
    return TrainMetrics(
        step=step,
        version=version,
        loss=_mean(sums.losses),
        reward_mean=float(rewards.mean()) if len(rewards) else 0.0,
        reward_std=float(rewards.std(unbiased=False)) if len(rewards) else 0.0,
        kl=sums.kl / max(sums.loss_tokens, 1) if config.kl_coef > 0 else None,
        clip_fraction=sums.clipped / max(sums.loss_tokens, 1),
        importance_weight_mean=(sums.weight / sums.kept if config.decoupled and sums.kept else 1.0),
        tokens=lay.tokens,
        off_policy_tokens=lay.off_policy_tokens,
        grad_norm=_mean(sums.norms),
        time_s=time_s,
    )


class GrpoTrainer(Trainer, ABC):
    """The shared half of a trainer (module docstring), declared a ``Trainer`` so that the
    type checker holds every backend to the protocol. ``named_parameters`` are the
    parameters the optimizer steps, under the backend's names (its optimizer state is saved
    under them); ``device`` is where microbatches go."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: ModelConfig,
        config: TrainerConfig,
        named_parameters: list[tuple[str, torch.nn.Parameter]],
        device: torch.device,
    ) -> None:
        self.model_dir, self.cfg, self.config, self.device = Path(model_dir), cfg, config, device
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.names = [n for n, _ in named_parameters]
        self.optimizer = adamw([p for _, p in named_parameters], config)
        self.rng = torch.Generator().manual_seed(config.seed)
        self.step = 0  # committed updates
        self._version = 0  # the model directory's weights are version 0

    # -- what a backend gives ----------------------------------------------------------------

    @abstractmethod
    def _logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """``[b, t]`` token ids on the device -> ``[b, t]`` float32: the policy's logprob of
        each token given those before it (entry 0: 0), with gradient."""

    @abstractmethod
    def _reference_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        """The same for the reference model (only called with ``kl_coef > 0``)."""

    @abstractmethod
    def hf_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face names, CPU copies (``dtype``: cast to it)."""

    @abstractmethod
    def _set_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in (every one of the model's)."""

    @property
    @abstractmethod
    def offloaded(self) -> bool: ...

    # -- the protocol ------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def train_step(self, batch: RolloutBatch) -> TrainMetrics:
        self._require_onloaded("train_step")
        if batch.policy_version > self._version:
            raise ValueError(
                f"batch {batch.batch_id}: policy version {batch.policy_version} is ahead of "
                f"the trainer's weights (version {self._version})"
            )
        outside = vocabulary_problem(batch, self.cfg.vocab_size)
        if outside is not None:
            raise ValueError(f"{outside[0]}: {outside[1]}")
        started = time.perf_counter()
        lay = layout(batch, self.config, self.rng)
        minibatches = [[m.to(self.device) for m in mb] for mb in lay.minibatches]
        self._before_first_step([m for mb in minibatches for m in mb])
        sums = LossSums()
        for minibatch in minibatches:
            self._optimizer_step(minibatch, sums)
        self.optimizer.zero_grad(set_to_none=True)  # no gradients held between updates
        self._version += 1
        self.step += 1
        elapsed = time.perf_counter() - started
        return train_metrics(
            lay, sums, self.config, step=self.step - 1, version=self._version, time_s=elapsed
        )

    def export_weights(self, out_dir: Path) -> Path:
        self._require_onloaded("export_weights")
        target = Path(out_dir) / WEIGHTS_DIR.format(self._version)
        with atomic_dir(target) as d:
            write_weights(d, self.hf_weights(DTYPES[self.cfg.torch_dtype]))
            copy_model_config(self.model_dir, d)
        return target

    def save_checkpoint(self, path: Path) -> None:
        self._require_onloaded("save_checkpoint")
        state = CheckpointState(
            step=self.step,
            version=self._version,
            weights=self.hf_weights(torch.float32),
            optimizer=self._optimizer_tensors(),
            rng={"shuffle": self.rng.get_state()},
            param_groups=self._param_groups(),
            config=self.config.model_dump(mode="json"),
        )
        write_checkpoint(Path(path), state, self.model_dir)

    def load_checkpoint(self, path: Path) -> None:
        path = Path(path)
        state = read_checkpoint(path)
        if sorted(state.weights) != sorted(weight_shapes(self.cfg)):
            raise InputError(path / STATE_FILE, "", "its weights are not this model's")
        self._set_hf_weights(state.weights)
        self._set_optimizer(state.optimizer, state.param_groups)
        if "shuffle" in state.rng:
            self.rng.set_state(state.rng["shuffle"])
        self.step, self._version = state.step, state.version

    # -- the update --------------------------------------------------------------------------

    @torch.no_grad()
    def _before_first_step(self, micros: list[Microbatch]) -> None:
        for micro in micros:
            if self.config.decoupled:
                micro.proximal = self._logprobs(micro.ids)
            if self.config.kl_coef > 0:
                micro.reference = self._reference_logprobs(micro.ids)

    def _optimizer_step(self, minibatch: list[Microbatch], sums: LossSums) -> None:
        tokens = sum(m.tokens for m in minibatch)
        if tokens == 0:
            return
        c = self.config
        self.optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for m in minibatch:
            parts = grpo_loss(
                self._logprobs(m.ids),
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
        norm = torch.nn.utils.clip_grad_norm_(self._parameters(), max_norm)
        self.optimizer.step()
        sums.losses.append(loss)
        sums.norms.append(float(norm))

    def _parameters(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _require_onloaded(self, what: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"{what}: the trainer is offloaded (onload first)")

    # -- the optimizer's state as tensors, by parameter name ----------------------------------

    def _param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's hyperparameters, each group's params as names."""
        groups = self.optimizer.state_dict()["param_groups"]
        return [{**g, "params": [self.names[i] for i in g["params"]]} for g in groups]

    def _optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer's per-parameter state: ``<param name>.<key>`` (AdamW: ``step``,
        ``exp_avg``, ``exp_avg_sq``), CPU copies."""
        out: dict[str, torch.Tensor] = {}
        for i, per_param in self.optimizer.state_dict()["state"].items():
            for key, value in per_param.items():
                out[f"{self.names[i]}.{key}"] = torch.as_tensor(value).detach().cpu().clone()
        return out

    def _set_optimizer(
        self, tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]
    ) -> None:
        """Load ``_optimizer_tensors``' form back (onto the parameters' devices)."""
        index = {n: i for i, n in enumerate(self.names)}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            name, _, what = key.rpartition(".")
            if name not in index:
                raise ValueError(f"optimizer state for {name!r}, not a parameter of the model")
            state.setdefault(index[name], {})[what] = value.clone()
        loaded = [{**g, "params": [index[n] for n in g["params"]]} for g in groups]
        self.optimizer.load_state_dict({"state": state, "param_groups": loaded})


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
