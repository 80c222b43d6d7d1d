"""Small random Qwen2 and Llama models built by ``transformers`` (the dev extra), for the
tests that hold pearl's own forward passes (the engine's, the trainer's, Megatron's) to
theirs. The caller seeds torch and writes the model with ``save_pretrained``."""

from __future__ import annotations

from typing import Any

SMALL = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    eos_token_id=2,
)


def transformers_model(arch: str, **overrides: Any) -> Any:
    """A ``Qwen2ForCausalLM`` or ``LlamaForCausalLM`` of ``SMALL``'s sizes (``overrides``
    change them), randomly initialised."""
    import transformers

    fields = SMALL | overrides
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields))
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
    raise ValueError(f"arch: {arch!r} is neither qwen2 nor llama")
