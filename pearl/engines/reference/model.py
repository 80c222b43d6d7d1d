"""The reference engine's model: a Qwen3/Qwen2/Llama decoder on torch, over a paged KV cache.

The forward pass is written here, not borrowed from ``transformers``, because the engine
batches sequences of different lengths whose keys and values live in a shared pool of
fixed-size blocks (a "slot" is one token's place in the pool: ``block * block_size +
offset``). One call computes the new tokens of several sequences at once: each sequence
brings its new token ids, how many of its tokens are already in the cache, and the slots
of all its tokens; the call writes the new keys and values into their slots, attends over
every slot of the sequence (causally), and returns the logits of each sequence's last new
token. ``tests/engines/test_model.py`` checks it against ``transformers`` on the same
weights.

The weights live in one flat buffer (each parameter a view into it), so that sleep level 2
frees them in one piece and a reload copies into them in place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pearl.engines.reference.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class SeqInput:
    """One sequence's part of a forward call."""

    token_ids: Sequence[int]  # the new tokens, in order
    start_pos: int  # tokens of the sequence already in the cache
    slots: torch.Tensor  # long: the slots of positions 0 .. start_pos + len(token_ids) - 1


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the model needs, by its Hugging Face name."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        }
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


class WeightError(ValueError):
    """Weights that do not fit the model (names or shapes)."""


class KVPool:
    """The key and value tensors of every slot, per layer; freed and re-made by sleep."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype) -> None:
        self.shape = (cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, cfg.head_dim)
        self.dtype = dtype
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.allocate()

    @property
    def bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return 2 * n * torch.tensor([], dtype=self.dtype).element_size()

    def allocate(self) -> None:
        if self.k is None:
            self.k = torch.zeros(self.shape, dtype=self.dtype)
            self.v = torch.zeros(self.shape, dtype=self.dtype)

    def release(self) -> None:
        self.k = self.v = None

    @property
    def allocated(self) -> bool:
        return self.k is not None


class CausalLM:
    """The decoder, its weights in one flat buffer."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.shapes = weight_shapes(cfg)
        self._flat: torch.Tensor | None = None
        self.params: dict[str, torch.Tensor] = {}
        half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
        self._inv_freq = (1.0 / (cfg.rope_theta**half)).to(torch.float32)

    @property
    def loaded(self) -> bool:
        return self._flat is not None

    @property
    def num_parameters(self) -> int:
        total = 0
        for shape in self.shapes.values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def _allocate(self) -> None:
        self._flat = torch.empty(self.num_parameters, dtype=self.dtype)
        offset = 0
        for name, shape in self.shapes.items():
            n = 1
            for d in shape:
                n *= d
            self.params[name] = self._flat[offset : offset + n].view(shape)
            offset += n

    def load(self, tensors: Mapping[str, torch.Tensor], *, partial: bool = False) -> None:
        """Copy ``tensors`` (Hugging Face names) into the weights; all of them unless
        ``partial`` (a pushed update may carry some). ``WeightError`` on a name the model
        does not have, a wrong shape, or (whole loads) a missing name; nothing is changed
        then."""
        unknown = sorted(set(tensors) - set(self.shapes) - {"lm_head.weight"})
        if unknown:
            raise WeightError(f"unexpected weights: {', '.join(unknown[:5])}")
        missing = sorted(set(self.shapes) - set(tensors))
        if missing and not partial:
            raise WeightError(f"missing weights: {', '.join(missing[:5])}")
        for name, t in tensors.items():
            if name in self.shapes and tuple(t.shape) != self.shapes[name]:
                raise WeightError(f"{name}: shape {tuple(t.shape)}, expected {self.shapes[name]}")
        if self._flat is None:
            if partial:
                raise WeightError("a partial update needs loaded weights")
            self._allocate()
        with torch.no_grad():
            for name, t in tensors.items():
                if name in self.params:  # a tied model ignores a stray lm_head
                    self.params[name].copy_(t)

    def release(self) -> None:
        self.params = {}
        self._flat = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.params.items()}

    # -- the forward pass --------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return (x32 * weight.float()).to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqInput], kv: KVPool) -> torch.Tensor:
        """The logits ``[len(seqs), vocab]`` of each sequence's last new token, having
        written the new tokens' keys and values into ``kv``."""
        assert self._flat is not None and kv.k is not None and kv.v is not None
        cfg, p = self.cfg, self.params
        n = len(seqs)
        tq = max(len(s.token_ids) for s in seqs)
        tk = max(s.start_pos + len(s.token_ids) for s in seqs)
        ids = torch.zeros(n, tq, dtype=torch.long)
        pos = torch.zeros(n, tq, dtype=torch.long)
        ctx = torch.zeros(n, tk, dtype=torch.long)
        q_valid = torch.zeros(n, tq, dtype=torch.bool)
        new_slots: list[torch.Tensor] = []
        for b, s in enumerate(seqs):
            m = len(s.token_ids)
            total = s.start_pos + m
            ids[b, :m] = torch.as_tensor(s.token_ids)
            pos[b, :m] = torch.arange(s.start_pos, total)
            ctx[b, :total] = s.slots[:total]
            q_valid[b, :m] = True
            new_slots.append(s.slots[s.start_pos : total])
        k_len = torch.tensor([s.start_pos + len(s.token_ids) for s in seqs])
        # key j is visible to query i when j < len and j <= pos(i)
        j = torch.arange(tk)
        mask = (j[None, None, :] <= pos[:, :, None]) & (j[None, None, :] < k_len[:, None, None])
        mask = mask[:, None, :, :]  # [n, 1, tq, tk]
        slots = torch.cat(new_slots)
        freqs = pos[..., None].float() * self._inv_freq  # [n, tq, hd/2]
        cos = torch.cat((freqs, freqs), -1).cos()[:, :, None, :]
        sin = torch.cat((freqs, freqs), -1).sin()[:, :, None, :]
        nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        x = F.embedding(ids, p["model.embed_tokens.weight"])
        for i in range(cfg.num_hidden_layers):
            pre = f"model.layers.{i}."
            h = self._norm(x, p[pre + "input_layernorm.weight"])
            a = pre + "self_attn."
            q = F.linear(h, p[a + "q_proj.weight"], p.get(a + "q_proj.bias")).view(n, tq, nh, hd)
            k = F.linear(h, p[a + "k_proj.weight"], p.get(a + "k_proj.bias")).view(n, tq, kvh, hd)
            v = F.linear(h, p[a + "v_proj.weight"], p.get(a + "v_proj.bias")).view(n, tq, kvh, hd)
            if cfg.qk_norm:
                q = self._norm(q, p[a + "q_norm.weight"])
                k = self._norm(k, p[a + "k_norm.weight"])
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            kv.k[i, slots] = k[q_valid]
            kv.v[i, slots] = v[q_valid]
            keys = kv.k[i][ctx].transpose(1, 2)  # [n, kvh, tk, hd]
            values = kv.v[i][ctx].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=nh != kvh
            )
            x = x + F.linear(out.transpose(1, 2).reshape(n, tq, nh * hd), p[a + "o_proj.weight"])
            h = self._norm(x, p[pre + "post_attention_layernorm.weight"])
            m_ = pre + "mlp."
            gated = F.silu(F.linear(h, p[m_ + "gate_proj.weight"])) * F.linear(
                h, p[m_ + "up_proj.weight"]
            )
            x = x + F.linear(gated, p[m_ + "down_proj.weight"])
        last = torch.tensor([len(s.token_ids) - 1 for s in seqs])
        x = self._norm(x[torch.arange(n), last], p["model.norm.weight"])
        head = p.get("lm_head.weight", p["model.embed_tokens.weight"])
        return F.linear(x, head).float()
