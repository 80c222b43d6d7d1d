"""TEMPORARY stand-in (replaced by the models branch)."""
from __future__ import annotations
import json
from dataclasses import dataclass
from pathlib import Path

@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str
    model_type: str

def load_config(model_dir: str | Path) -> ModelConfig:
    c = json.loads((Path(model_dir) / "config.json").read_text())
    return ModelConfig(c["architectures"][0], c["vocab_size"], c["hidden_size"], c["intermediate_size"],
        c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
        c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"], c["rms_norm_eps"],
        c.get("rope_theta") or c.get("rope_parameters", {}).get("rope_theta", 10000.0), c["max_position_embeddings"],
        c.get("tie_word_embeddings", False), c["model_type"] == "qwen3", c.get("attention_bias", False),
        (c["eos_token_id"],) if isinstance(c["eos_token_id"], int) else tuple(c["eos_token_id"]), c.get("bos_token_id"), "float32", c["model_type"])
