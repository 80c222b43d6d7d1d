"""``MegatronTrainer``: GRPO updates of Megatron-core's ``GPTModel`` in one CUDA process.

It implements ``pearl.trainer.protocol.Trainer`` through ``pearl.trainer.grpo.GrpoTrainer``,
the half it shares with the reference trainer: the batch layout (``pearl.trainer.batching``),
the update (decoupled proximal logprobs and the reference model's before the first step,
``loss.grpo_loss`` per microbatch, the gradient clipped, AdamW per minibatch), the metrics,
the export and the checkpoints, all from the same ``TrainerConfig``. Its own:

- the model call: ``[b, t]`` token ids -> the logprob of each token after the ones before
  it (Megatron's vocab-parallel cross entropy, float32, negated; ``model.token_logprobs``),
  padded with a 0 in front so that entry ``t`` is about token ``t``, the forward under
  bfloat16 autocast by default (``MegatronOptions.compute_dtype``); parameters and AdamW's
  state float32;
- the weights in and out under Hugging Face names (``names.py``); checkpoints hold the
  optimizer's state under Megatron's parameter names;
- with ``kl_coef > 0``, a second, frozen ``GPTModel`` of the model directory's weights;
- ``offload``: parameters, gradients, AdamW's state and the reference model to host memory,
  the GPU's cache emptied; ``onload`` moves them back.

What it does not do (yet): tensor, pipeline or data parallelism (one process holds whole
tensors; ``MegatronOptions`` refuses other sizes), sequence packing, Megatron's
distributed optimizer. Needs CUDA: Megatron's forward does not run on CPU (the CPU test
patches its two CUDA calls, ``tests/trainer/test_megatron.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from pearl.agents.batches import RolloutBatch
from pearl.engines.reference.config import ModelConfig
from pearl.engines.reference.weights import read_weights
from pearl.trainer.config import TrainerConfig
from pearl.trainer.grpo import GrpoTrainer
from pearl.trainer.megatron import model as mg
from pearl.trainer.megatron.config import MegatronOptions, load_megatron_config
from pearl.trainer.megatron.names import Spec
from pearl.trainer.protocol import TrainMetrics


class MegatronTrainer(GrpoTrainer):
    """Made by :meth:`start` (which does the I/O); the constructor only holds the parts."""

    def __init__(
        self,
        model_dir: Path,
        cfg: ModelConfig,
        spec: Spec,
        config: TrainerConfig,
        options: MegatronOptions,
        model: torch.nn.Module,
        reference: torch.nn.Module | None,
        device: torch.device,
    ) -> None:
        super().__init__(model_dir, cfg, config, list(model.named_parameters()), device)
        self.spec, self.options, self.model, self.reference = spec, options, model, reference
        self._offloaded = False

    @classmethod
    def start(
        cls,
        model_dir: str | Path,
        config: TrainerConfig | None = None,
        options: MegatronOptions | None = None,
        *,
        device: torch.device | None = None,
    ) -> MegatronTrainer:
        """Megatron's parallel state, the model from ``model_dir``'s config.json with its
        weights (and with ``kl_coef > 0`` the frozen reference model), and AdamW;
        ``version`` 0 is the directory's weights."""
        config = config or TrainerConfig()
        options = options or MegatronOptions()
        model_dir = Path(model_dir)
        cfg = load_megatron_config(model_dir)
        if device is None or (device.type == "cuda" and device.index is None):
            device = torch.device("cuda", torch.cuda.current_device())
        mg.init_parallel(device, seed=options.seed)
        spec = mg.resolve_spec(options.spec)
        weights = read_weights(model_dir)
        model = mg.build_model(cfg, spec=spec, device=device)
        mg.load_hf_weights(model, weights, cfg, spec)
        reference = None
        if config.kl_coef > 0:
            reference = mg.build_model(cfg, spec=spec, device=device)
            mg.load_hf_weights(reference, weights, cfg, spec)
            reference.requires_grad_(False)
            reference.eval()
        return cls(model_dir, cfg, spec, config, options, model, reference, device)

    @property
    def offloaded(self) -> bool:
        return self._offloaded

    # --- the model ------------------------------------------------------------------------

    def train_step(self, batch: RolloutBatch) -> TrainMetrics:
        self.model.train()  # dropout is 0: the same logprobs as eval, Megatron's train path
        return super().train_step(batch)

    def _logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        return self._forward(self.model, ids)

    def _reference_logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.reference is not None, "kl_coef > 0 makes the reference model"
        return self._forward(self.reference, ids)

    def _forward(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """``[b, t]`` -> ``[b, t]``: entry 0 is 0, entry ``t`` the logprob of token ``t``."""
        with torch.autocast(
            device_type=self.device.type,
            dtype=torch.bfloat16,
            enabled=self.options.compute_dtype == "bfloat16",
        ):
            shifted = mg.token_logprobs(model, ids)
        return F.pad(shifted.float(), (1, 0))

    def logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """The current weights' logprob of each token after the first, given those before it
        (what an engine reports for the same sequence), in float32 without autocast."""
        self._require_onloaded("logprobs")
        self.model.eval()
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        with torch.no_grad():
            return [float(x) for x in mg.token_logprobs(self.model, ids)[0].tolist()]

    def hf_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return mg.hf_weights(self.model, self.cfg, self.spec, dtype)

    def _set_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        mg.load_hf_weights(self.model, weights, self.cfg, self.spec)

    # --- lending the GPU ------------------------------------------------------------------

    def offload(self) -> None:
        """Parameters, gradients, AdamW's state and the reference model to host memory; the
        GPU's cache emptied."""
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

    def _move(self, device: torch.device) -> None:
        self.model.to(device)
        if self.reference is not None:
            self.reference.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = value.to(device)


def _clear_rotary_cache() -> None:
    """Megatron caches rotary embeddings per length (an ``lru_cache`` on the module's
    forward), on the GPU; dropped when offloading."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if clear is not None:
        clear()
