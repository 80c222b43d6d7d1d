"""A model directory's configuration: the fields of Hugging Face's ``config.json`` (and
``generation_config.json``) that the reference engine's forward pass needs.

Decoder-only transformers with RMSNorm, SwiGLU and rotary embeddings: Qwen3, Qwen2, Llama
and Mistral (no sliding window). Anything else, or a field the engine does not implement
(scaled RoPE, another activation), is an ``InputError`` naming ``config.json`` and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pearl.io.documents import InputError, read_object

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# architecture -> whether q and k get a per-head RMSNorm (Qwen3), q/k/v always biased (Qwen2)
_ARCHITECTURES = {
    "Qwen3ForCausalLM": (True, False),
    "Qwen2ForCausalLM": (False, True),
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
}
DTYPES = ("float32", "bfloat16", "float16")
_DEFAULT_ROPE_THETA = 10000.0  # transformers' default when a config names none


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a key of _ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # config's head_dim, else hidden_size // num_attention_heads
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # q_norm/k_norm per head (Qwen3)
    attention_bias: bool  # bias on q/k/v projections
    eos_token_ids: tuple[int, ...]  # config's, then generation_config.json's, no repeats
    bos_token_id: int | None
    torch_dtype: str  # one of DTYPES
    model_type: str


class _Fields:
    """Typed reads of one JSON object, each problem an ``InputError`` naming the field."""

    def __init__(self, doc: dict[str, Any], path: Path) -> None:
        self.doc, self.path = doc, path

    def error(self, field: str, problem: str) -> InputError:
        return InputError(str(self.path), field, problem)

    def has(self, field: str) -> bool:
        return self.doc.get(field) is not None

    def integer(self, field: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.doc.get(field, default)
        if value is None:
            raise self.error(field, "missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(field, f"must be an integer, not {value!r}")
        if value < minimum:
            raise self.error(field, f"must be at least {minimum}, not {value}")
        return value

    def number(self, field: str, default: float | None = None) -> float:
        value = self.doc.get(field, default)
        if value is None:
            raise self.error(field, "missing")
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self.error(field, f"must be a positive number, not {value!r}")
        return float(value)

    def flag(self, field: str, default: bool) -> bool:
        value = self.doc.get(field, default)
        if not isinstance(value, bool):
            raise self.error(field, f"must be true or false, not {value!r}")
        return value

    def text(self, field: str, default: str | None = None) -> str:
        value = self.doc.get(field, default)
        if value is None:
            raise self.error(field, "missing")
        if not isinstance(value, str) or not value:
            raise self.error(field, f"must be a non-empty string, not {value!r}")
        return value

    def token_ids(self, field: str) -> tuple[int, ...]:
        """An id or a list of ids; absent or null is none."""
        value = self.doc.get(field)
        ids = [] if value is None else value if isinstance(value, list) else [value]
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise self.error(field, f"must be a token id or a list of them, not {value!r}")
        return tuple(ids)


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``MODEL_DIR/config.json`` (and ``generation_config.json`` when present)."""
    path = Path(model_dir) / CONFIG_FILE
    f = _Fields(read_object(path), path)
    architecture = _architecture(f)
    qk_norm, always_biased = _ARCHITECTURES[architecture]
    _check_supported(f)
    hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    kv_heads = f.integer("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise f.error("num_key_value_heads", f"must divide num_attention_heads ({heads})")
    if f.has("head_dim"):
        head_dim = f.integer("head_dim")
    elif hidden % heads:
        raise f.error("hidden_size", f"not a multiple of num_attention_heads ({heads})")
    else:
        head_dim = hidden // heads
    eos_ids = f.token_ids("eos_token_id")
    bos_ids = f.token_ids("bos_token_id")
    generation = Path(model_dir) / GENERATION_CONFIG_FILE
    if generation.is_file():
        g = _Fields(read_object(generation), generation)
        eos_ids += g.token_ids("eos_token_id")
        bos_ids += g.token_ids("bos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=f.integer("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.integer("intermediate_size"),
        num_hidden_layers=f.integer("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.number("rms_norm_eps"),
        rope_theta=_rope_theta(f),
        max_position_embeddings=f.integer("max_position_embeddings"),
        tie_word_embeddings=f.flag("tie_word_embeddings", default=False),
        qk_norm=qk_norm,
        attention_bias=always_biased or f.flag("attention_bias", default=False),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        bos_token_id=bos_ids[0] if bos_ids else None,
        torch_dtype=_dtype(f),
        model_type=f.text("model_type"),
    )


def _architecture(f: _Fields) -> str:
    names = f.doc.get("architectures")
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
        raise f.error("architectures", f"must be a list of one name, not {names!r}")
    if names[0] not in _ARCHITECTURES:
        supported = ", ".join(_ARCHITECTURES)
        raise f.error("architectures", f"{names[0]} is not supported (only {supported})")
    return names[0]


def _check_supported(f: _Fields) -> None:
    """Reject what the forward pass does not implement rather than compute it wrongly."""
    act = f.doc.get("hidden_act", "silu")
    if act != "silu":
        raise f.error("hidden_act", f"{act!r} is not supported (only 'silu')")
    if f.doc.get("use_sliding_window"):
        raise f.error("use_sliding_window", "sliding-window attention is not supported")
    window = f.doc.get("sliding_window")
    if f.doc.get("model_type") == "mistral" and window is not None:
        raise f.error("sliding_window", "sliding-window attention is not supported")
    scaling = f.doc.get("rope_scaling")
    if scaling is not None and not _is_default_rope(scaling):
        raise f.error("rope_scaling", f"scaled RoPE is not supported ({_rope_kind(scaling)})")


def _is_default_rope(params: Any) -> bool:
    return isinstance(params, dict) and params.get("rope_type", params.get("type")) == "default"


def _rope_kind(params: Any) -> str:
    if isinstance(params, dict):
        kind = params.get("rope_type", params.get("type"))
        return f"type {kind!r}" if kind is not None else f"{params!r}"
    return f"{params!r}"


def _rope_theta(f: _Fields) -> float:
    """``rope_theta``, or transformers 5's ``rope_parameters: {rope_theta, rope_type}``."""
    params = f.doc.get("rope_parameters")
    if params is None:
        return f.number("rope_theta", default=_DEFAULT_ROPE_THETA)
    if not isinstance(params, dict):
        raise f.error("rope_parameters", f"must be an object, not {params!r}")
    if params.get("rope_type", "default") != "default":
        raise f.error("rope_parameters", f"scaled RoPE is not supported ({_rope_kind(params)})")
    theta = params.get("rope_theta", f.doc.get("rope_theta", _DEFAULT_ROPE_THETA))
    return _Fields({"rope_parameters.rope_theta": theta}, f.path).number(
        "rope_parameters.rope_theta"
    )


def _dtype(f: _Fields) -> str:
    field = "torch_dtype" if f.has("torch_dtype") else "dtype"
    dtype = f.text(field, default="float32")
    if dtype not in DTYPES:
        raise f.error(field, f"{dtype!r} is not supported (only {', '.join(DTYPES)})")
    return dtype
