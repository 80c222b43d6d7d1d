"""A model directory's ``config.json`` -> the arguments of Megatron-core's ``TransformerConfig``
and ``GPTModel``, and the trainer's own options.

No megatron or torch import: the arguments are plain values (the activation and dtypes by
name; ``model.py`` resolves them), so the mapping and its refusals are tested anywhere.

What maps (``docs/megatron.md`` has the table): layers, hidden size, ``intermediate_size``
-> ``ffn_hidden_size``, heads, ``num_key_value_heads`` -> ``num_query_groups`` (grouped-query
attention), ``head_dim`` -> ``kv_channels``, RMSNorm with ``rms_norm_eps``, the gated SiLU
MLP without biases, ``qk_layernorm`` for Qwen3's q/k norms, q/k/v biases for Qwen2
(``add_qkv_bias``), RoPE with ``rope_theta`` -> ``rotary_base``, and tied or untied embeddings.
Dropout is off (the trainer's logprobs must be the engine's). What ``load_config`` already
refuses (another activation, scaled RoPE, sliding windows, other architectures) stays
refused; on top, what Megatron's layers would compute differently: a bias on ``o_proj``
(``attention_bias`` outside Qwen2), on the MLP (``mlp_bias``), attention dropout, float16
training. Each refusal is one ``InputError`` line naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pearl.engines.reference.config import CONFIG_FILE, ModelConfig, load_config
from pearl.io.documents import InputError, parse, read_object

OPTIONS_SOURCE = "<megatron options>"  # where a problem with MegatronOptions is reported


class MegatronOptions(BaseModel):
    """How the Megatron trainer builds the model and runs its forward (what config.json
    does not say). The loss, the batch layout and AdamW are ``pearl.trainer.config.
    TrainerConfig``'s, the same as the reference trainer's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: Literal["auto", "local", "te"] = Field(
        "auto",
        description="The layer spec: 'local' (Megatron-core's own modules), 'te' (Transformer "
        "Engine's fused modules), 'auto' (te when transformer_engine imports, else local).",
    )
    tensor_model_parallel_size: Literal[1] = Field(
        1, description="Only 1: one process holds whole tensors (the export gathers no shards)."
    )
    pipeline_model_parallel_size: Literal[1] = Field(
        1, description="Only 1: every layer, the embedding and the output layer on one rank."
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16",
        description="The forward and backward under autocast; parameters and Adam's state "
        "stay float32 (float16 would need a loss scaler, and is refused).",
    )
    seed: int = Field(0, description="Megatron's model-parallel CUDA seed.")


def parse_options(data: dict[str, Any] | None = None) -> MegatronOptions:
    """Options from a mapping; the first problem is an ``InputError`` naming the field."""
    return parse(MegatronOptions, data or {}, OPTIONS_SOURCE)


def load_megatron_config(model_dir: str | Path) -> ModelConfig:
    """``load_config`` of the directory, plus the refusals of what Megatron's GPT layers do
    not compute as Hugging Face's model does."""
    cfg = load_config(model_dir)
    path = Path(model_dir) / CONFIG_FILE
    check_supported(cfg, read_object(path), path)
    return cfg


def check_supported(cfg: ModelConfig, doc: dict[str, Any], path: str | Path) -> None:
    """An ``InputError`` naming the first field of ``doc`` (config.json) that the mapping to
    Megatron does not carry."""
    if cfg.architecture != "Qwen2ForCausalLM" and doc.get("attention_bias"):
        raise InputError(
            path, "attention_bias", "a bias on o_proj is not supported (only on q, k, v)"
        )
    if doc.get("mlp_bias"):
        raise InputError(path, "mlp_bias", "MLP biases are not supported")
    dropout = doc.get("attention_dropout", 0.0)
    if dropout not in (0, 0.0, None):
        raise InputError(path, "attention_dropout", f"must be 0 for RL training, not {dropout!r}")
    if cfg.torch_dtype == "float16":
        field = "torch_dtype" if "torch_dtype" in doc else "dtype"
        raise InputError(path, field, "float16 is not supported (bfloat16 or float32)")


def transformer_config_kwargs(cfg: ModelConfig, *, on_cpu: bool = False) -> dict[str, Any]:
    """``TransformerConfig(**kwargs)``'s arguments for ``cfg``, with ``activation_func`` and
    ``params_dtype`` by name (``"silu"``, ``"float32"``). ``on_cpu``: parameters are made
    on the CPU (``use_cpu_initialization``), else on the current CUDA device. Weights are
    loaded after construction, so Megatron's random initialisation is skipped."""
    return {
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_query_groups": cfg.num_key_value_heads,
        "kv_channels": cfg.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": cfg.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": "silu",
        "add_bias_linear": False,
        "add_qkv_bias": cfg.attention_bias,
        "qk_layernorm": cfg.qk_norm,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "params_dtype": "float32",
        # unfused paths: the same arithmetic on either spec and on CPU
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
        "use_cpu_initialization": on_cpu,
        "perform_initialization": False,
    }


def gpt_model_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """``GPTModel(config, spec, **kwargs)``'s other arguments for ``cfg``."""
    return {
        "vocab_size": cfg.vocab_size,
        "max_sequence_length": cfg.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_percent": 1.0,
        "rotary_base": cfg.rope_theta,
        "share_embeddings_and_output_weights": cfg.tie_word_embeddings,
        "pre_process": True,
        "post_process": True,
        "parallel_output": True,
    }
