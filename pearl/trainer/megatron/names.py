"""Weights under Hugging Face names <-> Megatron-core ``GPTModel`` names, both ways.

Pure tensor work (torch only, no megatron import), so that the mapping is tested on any CPU.
The tables below are the whole mapping (``docs/megatron.md`` shows them with shapes):

- renamed one to one: the embedding, the final norm, the untied output layer, and per layer
  ``o_proj``, ``down_proj``, ``q_norm``/``k_norm`` and the two norms, which the local layer
  spec keeps as modules (``input_layernorm``, ``pre_mlp_layernorm``) and the Transformer
  Engine spec fuses into the next linear (``linear_qkv.layer_norm_weight``,
  ``linear_fc1.layer_norm_weight``);
- fused: ``q_proj``, ``k_proj``, ``v_proj`` -> ``linear_qkv``, laid out as Megatron's
  attention splits it: for each of the ``num_key_value_heads`` query groups, that group's
  ``heads / kv_heads`` query heads, then its key head, then its value head (rows of
  ``head_dim`` each; the bias, where q/k/v have one, the same way); and ``gate_proj``,
  ``up_proj`` -> ``linear_fc1`` = cat(gate, up) (Megatron's gated MLP applies the
  activation to the first half).

Invariants (tests/trainer/test_megatron.py): ``megatron_to_hf(hf_to_megatron(w)) == w`` bit
for bit (a fuse is a concatenation, a split a view of it); every name of either side is
mapped or refused (a missing, unexpected or misshapen tensor is a ``ValueError`` naming
it); with tied embeddings no ``lm_head.weight`` and no ``output_layer.weight`` appear.
One process, tensor parallel size 1: the tensors are whole, never shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from pearl.engines.reference.config import ModelConfig

Spec = Literal["local", "te"]  # the layer spec: Megatron-core's own modules, or Transformer Engine
SPECS: tuple[Spec, ...] = ("local", "te")

HF_LAYER = "model.layers.{}."
MG_LAYER = "decoder.layers.{}."

# Whole-model tensors, HF name -> Megatron name (lm_head only when untied).
GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}

# Per-layer tensors renamed one to one: HF suffix -> (local spec's suffix, TE spec's suffix).
LAYER_RENAMES: dict[str, tuple[str, str]] = {
    "input_layernorm.weight": (
        "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight",
    ),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight",) * 2,
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight",) * 2,
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight",) * 2,
    "post_attention_layernorm.weight": (
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight",
    ),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight",) * 2,
}

# Per-layer fused tensors: Megatron suffix <- HF suffixes, in the order they are fused.
QKV = "self_attention.linear_qkv.weight"
QKV_BIAS = "self_attention.linear_qkv.bias"
FC1 = "mlp.linear_fc1.weight"
LAYER_FUSED: dict[str, tuple[str, ...]] = {
    QKV: ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    QKV_BIAS: ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    FC1: ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of ``cfg`` holds, with its shape."""
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_out, hidden),
        "self_attn.k_proj.weight": (kv_out, hidden),
        "self_attn.v_proj.weight": (kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, q_out),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if cfg.attention_bias:
        layer |= {
            "self_attn.q_proj.bias": (q_out,),
            "self_attn.k_proj.bias": (kv_out,),
            "self_attn.v_proj.bias": (kv_out,),
        }
    if cfg.qk_norm:
        layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hidden)}
    for i in range(cfg.num_hidden_layers):
        out |= {HF_LAYER.format(i) + k: v for k, v in layer.items()}
    out["model.norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, hidden)
    return out


def megatron_name(hf_name: str, spec: Spec = "local") -> str:
    """The Megatron name of a renamed (not fused) HF tensor; a ``ValueError`` for others."""
    if hf_name in GLOBAL_RENAMES:
        return GLOBAL_RENAMES[hf_name]
    index, suffix = _split_layer(hf_name, "model.layers.")
    if suffix in LAYER_RENAMES:
        return MG_LAYER.format(index) + LAYER_RENAMES[suffix][SPECS.index(spec)]
    raise ValueError(f"{hf_name}: not a renamed tensor (fused, or unknown)")


def megatron_shapes(cfg: ModelConfig, spec: Spec = "local") -> dict[str, tuple[int, ...]]:
    """Every parameter a ``GPTModel`` of ``cfg`` with ``spec`` holds, with its shape (no
    ``_extra_state``)."""
    return {k: tuple(v.shape) for k, v in hf_to_megatron(_meta(cfg), cfg, spec).items()}


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], cfg: ModelConfig, spec: Spec = "local"
) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict under Megatron's names. With tied embeddings an
    ``lm_head.weight`` equal to the embedding (some checkpoints carry one) is dropped."""
    hf = dict(hf)
    if cfg.tie_word_embeddings and "lm_head.weight" in hf:
        head = hf.pop("lm_head.weight")
        if not torch.equal(head, hf.get("model.embed_tokens.weight", head)):
            raise ValueError("lm_head.weight: differs from the embedding, but they are tied")
    _check(hf, hf_shapes(cfg), "Hugging Face")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf.items():
        if name in GLOBAL_RENAMES or _layer_suffix(name) in LAYER_RENAMES:
            out[megatron_name(name, spec)] = tensor
    for i in range(cfg.num_hidden_layers):
        hp, mp = HF_LAYER.format(i), MG_LAYER.format(i)
        q, k, v = (hf[hp + s] for s in LAYER_FUSED[QKV])
        out[mp + QKV] = fuse_qkv(q, k, v, cfg)
        if cfg.attention_bias:
            qb, kb, vb = (hf[hp + s] for s in LAYER_FUSED[QKV_BIAS])
            out[mp + QKV_BIAS] = fuse_qkv(qb, kb, vb, cfg)
        gate, up = (hf[hp + s] for s in LAYER_FUSED[FC1])
        out[mp + FC1] = torch.cat([gate, up], dim=0)
    return out


def megatron_to_hf(
    mg: Mapping[str, torch.Tensor], cfg: ModelConfig, spec: Spec = "local"
) -> dict[str, torch.Tensor]:
    """A Megatron state dict (``_extra_state`` entries are skipped) under Hugging Face names,
    in the order of :func:`hf_shapes`."""
    mg = {k: v for k, v in mg.items() if not k.endswith("._extra_state")}
    wanted = hf_shapes(cfg)
    _check(mg, megatron_shapes(cfg, spec), "Megatron")
    out: dict[str, torch.Tensor] = {}
    for name in wanted:
        if name in GLOBAL_RENAMES or _layer_suffix(name) in LAYER_RENAMES:
            out[name] = mg[megatron_name(name, spec)]
    for i in range(cfg.num_hidden_layers):
        hp, mp = HF_LAYER.format(i), MG_LAYER.format(i)
        for suffix, parts in zip(LAYER_FUSED[QKV], split_qkv(mg[mp + QKV], cfg), strict=True):
            out[hp + suffix] = parts
        if cfg.attention_bias:
            biases = split_qkv(mg[mp + QKV_BIAS], cfg)
            for suffix, part in zip(LAYER_FUSED[QKV_BIAS], biases, strict=True):
                out[hp + suffix] = part
        gate, up = torch.chunk(mg[mp + FC1], 2, dim=0)
        out[hp + LAYER_FUSED[FC1][0]], out[hp + LAYER_FUSED[FC1][1]] = gate, up
    return {name: out[name] for name in wanted}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """``[q; k; v]`` rows (or bias entries) -> Megatron's per-group interleaving."""
    groups, d = cfg.num_key_value_heads, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fuse_qkv`."""
    groups, d = cfg.num_key_value_heads, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _meta(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {k: torch.empty(s, device="meta") for k, s in hf_shapes(cfg).items()}


def _layer_suffix(name: str) -> str | None:
    try:
        return _split_layer(name, "model.layers.")[1]
    except ValueError:
        return None


def _split_layer(name: str, prefix: str) -> tuple[int, str]:
    head, sep, rest = name.partition(prefix)
    index, dot, suffix = rest.partition(".")
    if head or not sep or not dot or not index.isdigit():
        raise ValueError(f"{name}: not a layer's tensor")
    return int(index), suffix


def _check(
    tensors: Mapping[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], side: str
) -> None:
    """Exactly the names of ``shapes``, each of its shape; else a ``ValueError`` naming one."""
    for name in tensors:
        if name not in shapes:
            raise ValueError(f"{name}: not a tensor of this model's {side} weights")
    for name, shape in shapes.items():
        if name not in tensors:
            raise ValueError(f"{name}: missing from the {side} weights")
        if tuple(tensors[name].shape) != shape:
            got = tuple(tensors[name].shape)
            raise ValueError(f"{name}: shape {list(got)}, this model's is {list(shape)}")
