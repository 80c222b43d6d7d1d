"""``MegatronTrainer``: GRPO updates of Megatron-core's ``GPTModel`` in one CUDA process.

The trainer protocol's shape (``pearl.trainer.protocol``): ``version``, ``train_step(batch)``,
``export_weights(out_dir)``, ``offload()``/``onload()``, ``save_checkpoint(path)``/
``load_checkpoint(path)``. One step:

1. the batch's trajectories (whole GRPO groups, ``pearl.agents.batches.RolloutBatch``) ->
   per-trajectory advantages from their rewards and groups (``grpo_advantages``);
2. per micro-batch of ``micro_batch_size`` trajectories, right-padded: the model's logprob
   of every token after the ones before it (Megatron's vocab-parallel cross entropy,
   float32), the policy loss against the engine's logprobs over the generated tokens
   (``policy_loss``), backward, scaled by the micro-batch's share of the batch's tokens;
3. clip to ``grad_clip_norm``, one AdamW step (parameters and Adam state float32, the
   forward under bfloat16 autocast by default), ``version`` + 1.

Tokens whose engine logprob is not finite (``-inf`` in batch files) carry no loss.

To align when merged with the trainer package: the loss functions are imported by the
names ``grpo_advantages(rewards, group_ids) -> advantages`` (one per trajectory) and
``policy_loss(logprobs=, old_logprobs=, advantages=, loss_mask=) -> scalar`` (a token mean
over ``loss_mask``; all ``[batch, tokens]``) from ``pearl.trainer.loss``, which another
branch writes; ``StepMetrics`` stands in for the protocol's ``TrainMetrics``.

What it does not do (yet): tensor, pipeline or data parallelism (one process holds whole
tensors; ``MegatronOptions`` refuses other sizes), sequence packing, Megatron's
distributed optimizer. Needs CUDA: Megatron's forward does not run on CPU.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pearl.agents.batches import RolloutBatch
from pearl.engines.reference.config import ModelConfig
from pearl.engines.reference.weights import INDEX_FILE, read_weights, write_weights
from pearl.trainer.megatron import model as mg
from pearl.trainer.megatron.config import MegatronOptions, load_megatron_config
from pearl.trainer.megatron.names import Spec

EXPORT_DIR = "v{:06d}"  # out_dir/v000003/: model.safetensors, config.json, the tokenizer
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# not copied into an export: the shards' index, and pearl model init's marker (the weights
# are no longer the ones it wrote)
_NOT_COPIED = {INDEX_FILE, "pearl_model.json"}


@dataclass(frozen=True)
class StepMetrics:
    """One update (to be the protocol's ``TrainMetrics`` when the trainer branches meet)."""

    version: int  # after the step
    loss: float  # the batch's policy loss (token mean)
    grad_norm: float  # before clipping
    num_trajectories: int
    num_loss_tokens: int
    duration_s: float


@dataclass(frozen=True)
class Packed:
    """A micro-batch as tensors; the token axis of all but ``token_ids`` is shifted by one
    (entry i is about token i + 1, predicted from tokens 0..i)."""

    token_ids: torch.Tensor  # [batch, seq] long, right-padded with 0
    loss_mask: torch.Tensor  # [batch, seq - 1] float: 1 for a generated token with a logprob
    old_logprobs: torch.Tensor  # [batch, seq - 1] float32: the engine's (0 where masked)
    advantages: torch.Tensor  # [batch, seq - 1] float32: the trajectory's, on every token


def pack(
    batch: RolloutBatch, advantages: torch.Tensor, rows: Sequence[int], device: torch.device
) -> Packed:
    """Trajectories ``rows`` of ``batch`` as a right-padded micro-batch."""
    trajectories = [batch.trajectories[i] for i in rows]
    seq = max(len(t.token_ids) for t in trajectories)
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    mask = torch.zeros(len(rows), seq)
    old = torch.zeros(len(rows), seq)
    for r, t in enumerate(trajectories):
        n = len(t.token_ids)
        ids[r, :n] = torch.tensor(t.token_ids, dtype=torch.long)
        mask[r, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        old[r, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
    usable = torch.isfinite(old) & (mask > 0)
    old = torch.where(usable, old, torch.zeros_like(old))
    adv = advantages[list(rows)].to(torch.float32)[:, None].expand(len(rows), seq - 1)
    return Packed(
        token_ids=ids.to(device),
        loss_mask=usable[:, 1:].to(torch.float32).to(device),
        old_logprobs=old[:, 1:].to(device),
        advantages=adv.contiguous().to(device),
    )


def _loss_functions() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``grpo_advantages`` and ``policy_loss`` of ``pearl.trainer.loss`` (module docstring)."""
    from pearl.trainer.loss import grpo_advantages, policy_loss  # type: ignore[import-not-found]

    return grpo_advantages, policy_loss


class MegatronTrainer:
    """Made by :meth:`start` (which does the I/O); the constructor only holds the parts."""

    def __init__(
        self,
        model_dir: Path,
        cfg: ModelConfig,
        spec: Spec,
        options: MegatronOptions,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        version: int = 0,
    ) -> None:
        self.model_dir, self.cfg, self.spec, self.options = model_dir, cfg, spec, options
        self.model, self.optimizer, self.device = model, optimizer, device
        self._version = version
        self._offloaded = False

    @classmethod
    def start(
        cls,
        model_dir: str | Path,
        options: MegatronOptions | None = None,
        device: torch.device | None = None,
    ) -> MegatronTrainer:
        """Megatron's parallel state, the model from ``model_dir``'s config.json with its
        weights, and AdamW; ``version`` 0 is the directory's weights."""
        options = options or MegatronOptions()
        model_dir = Path(model_dir)
        cfg = load_megatron_config(model_dir)
        if device is None or (device.type == "cuda" and device.index is None):
            device = torch.device("cuda", torch.cuda.current_device())
        mg.init_parallel(device, seed=options.seed)
        spec = mg.resolve_spec(options.spec)
        model = mg.build_model(cfg, spec=spec, device=device)
        mg.load_hf_weights(model, read_weights(model_dir), cfg, spec)
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=options.lr,
            betas=(options.adam_beta1, options.adam_beta2),
            eps=options.adam_eps,
            weight_decay=options.weight_decay,
        )
        return cls(model_dir, cfg, spec, options, model, optimizer, device)

    @property
    def version(self) -> int:
        return self._version

    # --- training -------------------------------------------------------------------------

    def train_step(self, batch: RolloutBatch) -> StepMetrics:
        self._check_onloaded()
        started = time.monotonic()
        grpo_advantages, policy_loss = _loss_functions()
        rewards = torch.tensor([t.reward for t in batch.trajectories], dtype=torch.float32)
        groups = torch.tensor(batch.group_ids, dtype=torch.long)
        advantages = grpo_advantages(rewards, groups)
        chunks = self._micro_batches(batch, advantages)
        total = sum(int(p.loss_mask.sum().item()) for p in chunks)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for p in chunks:
            tokens = int(p.loss_mask.sum().item())
            if tokens == 0:
                continue
            with self._autocast():
                logprobs = mg.token_logprobs(self.model, p.token_ids)
            loss = policy_loss(
                logprobs=logprobs.float(),
                old_logprobs=p.old_logprobs,
                advantages=p.advantages,
                loss_mask=p.loss_mask,
            )
            torch.autograd.backward(loss * (tokens / total))
            loss_sum += float(loss.item()) * tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.options.grad_clip_norm
        )
        if total:
            self.optimizer.step()
            self._version += 1
        self.optimizer.zero_grad(set_to_none=True)  # no gradients held between steps
        return StepMetrics(
            version=self._version,
            loss=loss_sum / total if total else 0.0,
            grad_norm=float(grad_norm),
            num_trajectories=len(batch.trajectories),
            num_loss_tokens=total,
            duration_s=time.monotonic() - started,
        )

    def logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """The current weights' logprob of each token after the first, given those before it
        (what an engine reports for the same sequence), in float32 without autocast."""
        self._check_onloaded()
        self.model.eval()
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        with torch.no_grad():
            return [float(x) for x in mg.token_logprobs(self.model, ids)[0].tolist()]

    # --- weights out ----------------------------------------------------------------------

    def export_weights(self, out_dir: str | Path) -> Path:
        """``OUT_DIR/v{version:06d}/``: the weights under Hugging Face names in the model's
        dtype (``model.safetensors``) beside the model directory's config.json, generation
        config and tokenizer files; it appears whole or not at all (made beside, renamed)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        target = out / EXPORT_DIR.format(self._version)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=out))
        try:
            dtype = _TORCH_DTYPES[self.cfg.torch_dtype]
            write_weights(staging, mg.hf_weights(self.model, self.cfg, self.spec, dtype))
            for f in sorted(self.model_dir.iterdir()):
                if (
                    f.is_file()
                    and not f.name.endswith(".safetensors")
                    and f.name not in _NOT_COPIED
                ):
                    shutil.copy2(f, staging / f.name)
            os.chmod(staging, 0o755)
            _replace_dir(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target

    # --- lending the GPU ------------------------------------------------------------------

    def offload(self) -> None:
        """Parameters, gradients and Adam's state to host memory; the GPU's cache emptied."""
        if self._offloaded:
            return
        self._move(torch.device("cpu"))
        _clear_rotary_cache()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._offloaded = True

    def onload(self) -> None:
        if not self._offloaded:
            return
        self._move(self.device)
        self._offloaded = False

    # --- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path) -> None:
        """The version, the weights (Megatron names, float32) and Adam's state in one file,
        written beside and renamed."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "version": self._version,
            "spec": self.spec,
            "model": {k: v.detach().cpu() for k, v in mg.megatron_tensors(self.model).items()},
            "optimizer": self.optimizer.state_dict(),
        }
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        try:
            torch.save(state, tmp)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load_checkpoint(self, path: str | Path) -> None:
        self._check_onloaded()
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
        if state["spec"] != self.spec:
            raise ValueError(f"{path}: spec: saved with {state['spec']!r}, this is {self.spec!r}")
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        left = [k for k in missing if not k.endswith(mg.EXTRA_STATE)]
        if left or unexpected:
            raise ValueError(f"{path}: {(left or unexpected)[0]}: does not fit this model")
        self.optimizer.load_state_dict(state["optimizer"])
        self._version = int(state["version"])

    # --- helpers --------------------------------------------------------------------------

    def _micro_batches(self, batch: RolloutBatch, advantages: torch.Tensor) -> list[Packed]:
        n, size = len(batch.trajectories), self.options.micro_batch_size
        return [
            pack(batch, advantages, range(i, min(i + size, n)), self.device)
            for i in range(0, n, size)
        ]

    def _autocast(self) -> torch.autocast:
        return torch.autocast(
            device_type=self.device.type,
            dtype=torch.bfloat16,
            enabled=self.options.compute_dtype == "bfloat16",
        )

    def _move(self, device: torch.device) -> None:
        self.model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = value.to(device)

    def _check_onloaded(self) -> None:
        if self._offloaded:
            raise RuntimeError("the trainer is offloaded: onload() first")


def _replace_dir(staging: Path, target: Path) -> None:
    """``staging`` becomes ``target``; an old ``target`` is renamed aside, then removed."""
    if not target.exists():
        os.replace(staging, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.replace(target, old / target.name)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


def _clear_rotary_cache() -> None:
    """Megatron caches rotary embeddings per length (an ``lru_cache`` on the module's
    forward), on the GPU; dropped when offloading."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if clear is not None:
        clear()
