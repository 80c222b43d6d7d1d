"""The trainer's model: a differentiable decoder-only causal LM in torch (Qwen3, Qwen2,
Llama, Mistral: the architectures ``pearl.engines.reference.config`` reads).

Its parameters carry Hugging Face's names (``model.layers.0.self_attn.q_proj.weight``):
the module tree mirrors transformers' (``model.embed_tokens``, ``model.layers[i]``,
``model.norm``, ``lm_head`` unless tied), and the parameter set is exactly the reference
engine's ``weight_shapes`` (so what the trainer exports, the engine loads, and the other
way round). Parameters are float32 whatever the model's ``torch_dtype`` (master weights);
``export`` casts them back.

The forward pass is batched with **right padding**: ``input_ids`` is ``[batch, length]``,
each row a sequence starting at position 0, padded at its end with any id. No attention
mask is needed: attention is causal, so a real token never sees a pad that comes after it;
the outputs at pad positions are garbage and the caller masks them (the loss mask is 0
there). ``token_logprobs`` returns ``[batch, length]``: entry ``t`` is the log-probability
of ``input_ids[:, t]`` given the tokens before it, under the raw distribution
(log-softmax of the logits, no temperature: what the engines report as behaviour
logprobs), and entry 0 is 0 (the first token has no context). ``tests/trainer/
test_model.py`` checks it against transformers and against the reference engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pearl.engines.reference.config import ModelConfig, load_config
from pearl.engines.reference.model import DTYPES, WeightError, weight_shapes
from pearl.engines.reference.weights import read_weights

LM_HEAD = "lm_head.weight"


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd, nh, kvh = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.heads, self.kv_heads, self.head_dim = nh, kvh, hd
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, nh * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kvh * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kvh * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q = self.q_proj(h).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, t, hd]
        groups = self.heads // self.kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        merged = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        projected: torch.Tensor = self.o_proj(merged)
        return projected


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class PolicyModel(nn.Module):
    """The causal LM; ``from_dir`` reads a Hugging Face model directory."""

    inv_freq: torch.Tensor  # the rotary frequencies (a buffer, not saved)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, False)
        )
        half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
        inv_freq = (1.0 / (cfg.rope_theta**half)).to(torch.float32)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> PolicyModel:
        m = cls(load_config(model_dir))
        m.load_weights(read_weights(model_dir))
        return m

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy every weight (Hugging Face names) in; ``WeightError`` on an unknown or
        missing name or a wrong shape, before anything is changed. A tied model ignores a
        stray ``lm_head.weight``."""
        shapes = weight_shapes(self.cfg)
        unknown = sorted(set(tensors) - set(shapes) - {LM_HEAD})
        missing = sorted(set(shapes) - set(tensors))
        if unknown or missing:
            raise WeightError(f"unexpected: {unknown[:5]}, missing: {missing[:5]}")
        for name, shape in shapes.items():
            if tuple(tensors[name].shape) != shape:
                raise WeightError(f"{name}: shape {tuple(tensors[name].shape)}, expected {shape}")
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name in shapes:
                params[name].copy_(tensors[name].to(torch.float32))

    def hf_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Every parameter under its Hugging Face name (a copy, in ``dtype``)."""
        return {n: p.detach().to(dtype).clone() for n, p in self.named_parameters()}

    def export_dtype(self) -> torch.dtype:
        """The dtype the model's ``config.json`` names (what the engines load)."""
        return DTYPES[self.cfg.torch_dtype]

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[batch, length, vocab]`` float32 logits of the next token at each position."""
        t = input_ids.shape[1]
        freqs = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq  # [t, hd/2]
        angles = torch.cat((freqs, freqs), dim=-1)[None, :, None, :]  # [1, t, 1, hd]
        cos, sin = angles.cos(), angles.sin()
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head).float()

    def token_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[batch, length]``: the log-probability of each token given those before it
        (0 at position 0); see the module docstring for padding."""
        logits = self.logits(input_ids[:, :-1])
        chosen = logits.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        scored = chosen - torch.logsumexp(logits, dim=-1)
        return F.pad(scored, (1, 0))
