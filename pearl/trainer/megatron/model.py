"""Megatron-core's ``GPTModel`` for a Hugging Face model directory: one process, whole tensors.

- :func:`init_parallel` sets up ``torch.distributed`` (world size 1: gloo on CPU, NCCL on
  CUDA) and Megatron's ``parallel_state`` (tensor and pipeline parallel 1), once per
  process; on CUDA it also seeds Megatron's RNG tracker (``model_parallel_cuda_manual_seed``
  needs CUDA; construction on CPU does not need it).
- :func:`build_model` makes the ``GPTModel`` from ``config.transformer_config_kwargs`` and
  the local layer spec (``get_gpt_layer_local_spec(qk_layernorm=..., normalization=
  "RMSNorm")``) or the Transformer Engine one (``get_gpt_layer_with_transformer_engine_spec``).
- :func:`load_hf_weights` / :func:`hf_weights` move weights in and out under Hugging Face's
  names (``names.py``).

Construction works on CPU; the forward pass does not (Megatron's rotary embedding moves its
frequencies to ``torch.cuda.current_device()``, the default causal mask and the attention
dropout's RNG fork are CUDA's), so the trainer runs on a GPU. The CPU test patches those
three edges to check the logits against transformers (tests/trainer/test_megatron.py).
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from pearl.engines.reference.config import ModelConfig
from pearl.io.extras import require
from pearl.trainer.megatron.config import gpt_model_kwargs, transformer_config_kwargs
from pearl.trainer.megatron.names import Spec, hf_to_megatron, megatron_to_hf

EXTRA_STATE = "._extra_state"  # Megatron's per-module metadata (FP8 scales), not weights
_ACTIVATIONS = {"silu": F.silu}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_spec(spec: str) -> Spec:
    """``auto`` -> ``te`` when Transformer Engine is installed, else ``local``."""
    if spec == "auto":
        return "te" if transformer_engine_available() else "local"
    if spec == "te":
        return "te"
    if spec == "local":
        return "local"
    raise ValueError(f"spec: {spec!r} is not one of auto, local, te")


def init_parallel(device: torch.device, seed: int = 0) -> None:
    """One process as the whole world: ``torch.distributed`` (if not already up; the
    rendezvous on ``MASTER_ADDR``/``MASTER_PORT``, a free local port when unset) and
    Megatron's model-parallel groups of size 1 (if not already made)."""
    require("megatron")
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL's communicators are made
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1
        )
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy_parallel() -> None:
    """Undo :func:`init_parallel` (tests; a trainer process just exits)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def transformer_config(cfg: ModelConfig, *, on_cpu: bool) -> Any:
    """Megatron's ``TransformerConfig`` for ``cfg`` (names resolved to torch objects)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = transformer_config_kwargs(cfg, on_cpu=on_cpu)
    kwargs["activation_func"] = _ACTIVATIONS[kwargs["activation_func"]]
    kwargs["params_dtype"] = _DTYPES[kwargs["params_dtype"]]
    return TransformerConfig(**kwargs)


def layer_spec(cfg: ModelConfig, spec: Spec) -> Any:
    """The ``ModuleSpec`` of one transformer layer."""
    from megatron.core.models.gpt import gpt_layer_specs

    if spec == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_norm)
    return gpt_layer_specs.get_gpt_layer_local_spec(
        qk_layernorm=cfg.qk_norm, normalization="RMSNorm"
    )


def build_model(cfg: ModelConfig, *, spec: Spec, device: torch.device) -> torch.nn.Module:
    """A ``GPTModel`` for ``cfg`` with float32 parameters on ``device``, uninitialised (load
    weights next). Needs :func:`init_parallel` first."""
    from megatron.core.models.gpt import GPTModel

    on_cpu = device.type == "cpu"
    model: torch.nn.Module = GPTModel(
        config=transformer_config(cfg, on_cpu=on_cpu),
        transformer_layer_spec=layer_spec(cfg, spec),
        **gpt_model_kwargs(cfg),
    )
    return model.to(device)


def megatron_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without ``_extra_state`` entries: its weights by name."""
    return {
        k: v
        for k, v in model.state_dict().items()
        if not k.endswith(EXTRA_STATE) and isinstance(v, torch.Tensor)
    }


def load_hf_weights(
    model: torch.nn.Module, hf: Mapping[str, torch.Tensor], cfg: ModelConfig, spec: Spec
) -> None:
    """Copy Hugging Face-named weights into the model (cast to its dtype and device). Every
    weight of the model is set; a ``ValueError`` names one that does not fit."""
    mapped = hf_to_megatron(hf, cfg, spec)
    have = megatron_tensors(model)
    if set(have) != set(mapped):
        extra = sorted(set(mapped) - set(have)) or sorted(set(have) - set(mapped))
        raise ValueError(f"{extra[0]}: the model's names differ from the mapping's")
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    left = [k for k in missing if not k.endswith(EXTRA_STATE)]
    if left or unexpected:
        raise ValueError(f"{(left or unexpected)[0]}: not loaded")


def hf_weights(
    model: torch.nn.Module, cfg: ModelConfig, spec: Spec, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names, as contiguous CPU tensors (``dtype``:
    cast to it)."""
    cpu = {
        k: v.detach().to("cpu", dtype=dtype or v.dtype) for k, v in megatron_tensors(model).items()
    }
    return {k: v.contiguous() for k, v in megatron_to_hf(cpu, cfg, spec).items()}


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor | None:
    """The attention mask ``GPTModel.forward`` takes (True = masked): None on CUDA, where
    Megatron builds its own causal mask (and Transformer Engine's attention ignores one);
    an explicit one elsewhere, since Megatron's default mask is made on CUDA."""
    if device.type == "cuda":
        return None
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def logits(model: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` token ids (right-padded) -> ``[batch, seq, vocab]`` logits."""
    batch, seq = token_ids.shape
    positions = torch.arange(seq, device=token_ids.device).expand(batch, seq)
    out: torch.Tensor = model(
        input_ids=token_ids,
        position_ids=positions,
        attention_mask=causal_mask(seq, token_ids.device),
    )
    return out


def token_logprobs(model: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` token ids -> ``[batch, seq - 1]``: the logprob of each token after
    the ones before it (Megatron's vocab-parallel cross entropy, in float32, negated)."""
    batch, seq = token_ids.shape
    positions = torch.arange(seq, device=token_ids.device).expand(batch, seq)
    labels = torch.roll(token_ids, -1, dims=1)  # position i predicts token i + 1; last unused
    loss: torch.Tensor = model(
        input_ids=token_ids,
        position_ids=positions,
        attention_mask=causal_mask(seq, token_ids.device),
        labels=labels,
    )
    return -loss[:, :-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
