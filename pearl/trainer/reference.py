"""The reference trainer: GRPO with AReaL's decoupled loss on the torch model, AdamW, on
CPU. It implements ``pearl.trainer.protocol.Trainer``; ``docs/training.md`` says what it
computes.

What it shares with the Megatron trainer (``pearl.trainer.grpo.GrpoTrainer``): the batch
layout (``pearl.trainer.batching``), the update (proximal and reference logprobs before the
first step, ``loss.grpo_loss`` per microbatch, the gradient clipped, AdamW per minibatch),
the metrics, the export and the checkpoints. Its own: the model (``PolicyModel``, its
``token_logprobs`` is the model call) and the memory.

Memory: ``offload`` writes the weights and the optimizer state to a file (on CPU there is
no other place to put them; ``offload_dir``) and frees them, and the heap is trimmed so
the process's RSS shows it; ``onload`` reads them back, bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pearl.engines.reference.model import weight_shapes
from pearl.trainer.config import TrainerConfig
from pearl.trainer.grpo import GrpoTrainer
from pearl.trainer.model import PolicyModel

__all__ = ["OFFLOAD_FILE", "ReferenceTrainer", "TrainerConfig"]

OFFLOAD_FILE = "offload.safetensors"


def _trim_heap() -> None:
    """Hand freed memory back to the operating system, so an offload shows in the RSS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class ReferenceTrainer(GrpoTrainer):
    """GRPO on the model in ``model_dir`` (a Hugging Face directory); see the module
    docstring."""

    def __init__(self, model_dir: str | Path, config: TrainerConfig | None = None) -> None:
        config = config or TrainerConfig()
        model = PolicyModel.from_dir(model_dir)
        super().__init__(
            model_dir, model.cfg, config, list(model.named_parameters()), torch.device("cpu")
        )
        self.model = model
        self.shapes = weight_shapes(model.cfg)
        self.reference = self._reference_model() if config.kl_coef > 0 else None
        self._offloaded: Path | None = None  # the offload file while offloaded

    def _reference_model(self) -> PolicyModel:
        ref = PolicyModel.from_dir(self.model_dir)
        ref.requires_grad_(False)
        return ref

    @property
    def offloaded(self) -> bool:
        return self._offloaded is not None

    # -- the model ---------------------------------------------------------------------------

    def _logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.token_logprobs(ids)

    def _reference_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.reference is not None, "kl_coef > 0 makes the reference model"
        return self.reference.token_logprobs(ids)

    def hf_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return self.model.hf_state_dict(dtype or torch.float32)

    def _set_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        for name in params:
            if tuple(weights[name].shape) != self.shapes[name]:
                raise ValueError(f"{name}: shape {tuple(weights[name].shape)}, not the model's")
        for name, p in params.items():  # copies: never views of a (mapped) file
            p.data = weights[name].to(torch.float32, copy=True).contiguous()

    # -- memory ------------------------------------------------------------------------------

    def offload(self) -> None:
        if self._offloaded is not None:
            return
        folder = self.config.offload_dir or Path(tempfile.mkdtemp(prefix="pearl-offload-"))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / OFFLOAD_FILE
        weights = {f"param.{n}": p.detach() for n, p in self.model.named_parameters()}
        save_file(weights | self._optimizer_tensors(), path)
        for p in self.model.parameters():
            p.data = torch.empty(0)
            p.grad = None
        self.optimizer.state.clear()  # its param_groups (the hyperparameters) stay
        self.reference = None
        self._offloaded = path
        _trim_heap()

    def onload(self) -> None:
        if self._offloaded is None:
            return
        path, tensors = self._offloaded, load_file(self._offloaded)
        weights = {k[6:]: v for k, v in tensors.items() if k.startswith("param.")}
        self._set_hf_weights(weights)
        optimizer = {k: v for k, v in tensors.items() if not k.startswith("param.")}
        self._set_optimizer(optimizer, self._param_groups())
        if self.config.kl_coef > 0:
            self.reference = self._reference_model()
        self._offloaded = None
        path.unlink(missing_ok=True)
        if self.config.offload_dir is None:
            shutil.rmtree(path.parent, ignore_errors=True)

    def load_checkpoint(self, path: Path) -> None:
        super().load_checkpoint(path)
        if self._offloaded is not None:  # the checkpoint replaces the offloaded state
            self._offloaded.unlink(missing_ok=True)
            self._offloaded = None
        if self.config.kl_coef > 0 and self.reference is None:
            self.reference = self._reference_model()
