"""``pearl model init``: a tiny Qwen3 written offline in Hugging Face format.

Random weights (normal(0, std) from a seeded ``torch.Generator``, norms at 1) and a
byte-level BPE tokenizer trained on the corpus shipped in ``pearl/data``; the same
arguments give byte-identical files. transformers and vLLM load the directory as they load
a real Qwen3; transformers is not needed to write it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import tokenizers
import torch
from tokenizers import AddedToken, decoders, pre_tokenizers, processors, trainers

from pearl.engines.reference.chat_template import CHATML_TEMPLATE
from pearl.engines.reference.config import CONFIG_FILE, DTYPES, GENERATION_CONFIG_FILE
from pearl.engines.reference.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from pearl.engines.reference.weights import write_weights
from pearl.io.documents import InputError

MARKER_FILE = "pearl_model.json"  # the arguments it was written with; marks it as pearl's
PAD_TOKEN, IM_START, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)  # skipped when decoding
TAG_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")  # kept when decoding
BYTE_TOKENS = 256
_ARGS = "<model init>"  # where an argument problem is reported
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The weights' spread. Hugging Face initialises at 0.02, but a random model that small is
# degenerate: its greedy output repeats the prompt's last token whatever the weights, so
# tests of batching, PD, migration and reloads would hold vacuously. At 0.3 the logits
# spread (about sqrt(hidden) * std) and greedy output varies with prompt and weights.
DEFAULT_STD = 0.3


def init_model(
    out_dir: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int | None = None,
    vocab: int = 512,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    dtype: str = "float32",
    std: float = DEFAULT_STD,
    overwrite: bool = False,
) -> Path:
    """Write the model to ``out_dir`` (created) and return its path. The directory appears
    complete or not at all; an existing one is replaced when it is empty or a pearl-written
    model, and otherwise only with ``overwrite``."""
    arguments = {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim if head_dim is not None else _default_head_dim(hidden, heads),
        "intermediate": intermediate if intermediate is not None else _round_up(3 * hidden, 8),
        "vocab": vocab,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
        "dtype": dtype,
        "std": std,
    }
    _check(arguments)
    out = Path(out_dir)
    _check_replaceable(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _write(staging, arguments)
        _replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write(folder: Path, a: dict[str, Any]) -> None:
    tokenizer = _train_tokenizer(a["vocab"])
    ids = {t: _id(tokenizer, t) for t in (*SPECIAL_TOKENS, *TAG_TOKENS)}
    tokenizer.save(str(folder / TOKENIZER_FILE), pretty=True)
    _write_json(folder / TOKENIZER_CONFIG_FILE, _tokenizer_config(ids, a))
    _write_json(folder / CONFIG_FILE, _config(a, bos=ids[PAD_TOKEN], eos=ids[EOS_TOKEN]))
    generation = {
        "bos_token_id": ids[PAD_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
    }
    _write_json(folder / GENERATION_CONFIG_FILE, generation)
    write_weights(folder, _weights(a))
    _write_json(folder / MARKER_FILE, {"written_by": "pearl model init", "arguments": a})


def _id(tokenizer: tokenizers.Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    assert found is not None, f"{token} was added to the tokenizer"
    return int(found)


def _default_head_dim(hidden: int, heads: int) -> int:
    if heads < 1 or hidden % heads:
        raise InputError(_ARGS, "head_dim", f"hidden ({hidden}) is not a multiple of heads")
    return hidden // heads


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check(a: dict[str, Any]) -> None:
    for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate"):
        if a[name] < 1:
            raise InputError(_ARGS, name, f"must be at least 1, not {a[name]}")
    if a["heads"] % a["kv_heads"]:
        raise InputError(_ARGS, "kv_heads", f"must divide heads ({a['heads']})")
    if a["head_dim"] % 2:
        raise InputError(_ARGS, "head_dim", f"must be even (rotary pairs), not {a['head_dim']}")
    least = BYTE_TOKENS + len(SPECIAL_TOKENS) + len(TAG_TOKENS)
    if a["vocab"] < least:
        raise InputError(_ARGS, "vocab", f"must be at least {least} (bytes and specials)")
    if a["max_position_embeddings"] < 1:
        raise InputError(_ARGS, "max_position_embeddings", "must be at least 1")
    if a["dtype"] not in DTYPES:
        raise InputError(_ARGS, "dtype", f"{a['dtype']!r} is not one of {', '.join(DTYPES)}")
    if not a["std"] > 0:
        raise InputError(_ARGS, "std", f"must be positive, not {a['std']}")


def _check_replaceable(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise InputError(_ARGS, "out", f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER_FILE).is_file() and not overwrite:
        raise InputError(
            _ARGS, "out", f"{out} is not empty and not a pearl model (overwrite replaces it)"
        )


def _replace(staging: Path, out: Path) -> None:
    """Move the finished directory into place; an old one is renamed aside first, then
    removed (a reader sees the old model, then briefly none, then the new one)."""
    os.chmod(staging, 0o755)  # mkdtemp makes it private
    if not out.exists():
        os.replace(staging, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    os.replace(out, old / out.name)
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def _corpus() -> list[str]:
    text = (resources.files("pearl") / "data" / "tokenizer_corpus.txt").read_text("utf-8")
    return text.splitlines(keepends=True)


def _train_tokenizer(vocab: int) -> tokenizers.Tokenizer:
    """Byte-level BPE to ``vocab`` ids, the specials and tags added last (as Qwen's are).
    Smaller when the corpus runs out of merges; the embedding keeps ``vocab`` rows."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(SPECIAL_TOKENS) - len(TAG_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_special_tokens([_added(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([_added(t, special=False) for t in TAG_TOKENS])
    return tokenizer


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(
        content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special
    )


def _tokenizer_config(ids: dict[str, int], a: dict[str, Any]) -> dict[str, Any]:
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t, i in sorted(ids.items(), key=lambda item: item[1])
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json as written
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": a["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
    }


def _config(a: dict[str, Any], bos: int, eos: int) -> dict[str, Any]:
    """What ``transformers.Qwen3Config`` reads, as Qwen3's own config.json writes it."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "head_dim": a["head_dim"],
        "hidden_act": "silu",
        "hidden_size": a["hidden"],
        "initializer_range": a["std"],
        "intermediate_size": a["intermediate"],
        "max_position_embeddings": a["max_position_embeddings"],
        "max_window_layers": a["layers"],
        "num_attention_heads": a["heads"],
        "num_hidden_layers": a["layers"],
        "num_key_value_heads": a["kv_heads"],
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": a["dtype"],
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": a["vocab"],
    }


def _weights(a: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Hugging Face's names and shapes, drawn in this order; no lm_head (tied)."""
    hidden, head_dim, inter = a["hidden"], a["head_dim"], a["intermediate"]
    q_out, kv_out = a["heads"] * head_dim, a["kv_heads"] * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (a["vocab"], hidden))
    ]
    for i in range(a["layers"]):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (hidden,)),
            (f"{p}.self_attn.q_proj.weight", (q_out, hidden)),
            (f"{p}.self_attn.k_proj.weight", (kv_out, hidden)),
            (f"{p}.self_attn.v_proj.weight", (kv_out, hidden)),
            (f"{p}.self_attn.o_proj.weight", (hidden, q_out)),
            (f"{p}.self_attn.q_norm.weight", (head_dim,)),
            (f"{p}.self_attn.k_norm.weight", (head_dim,)),
            (f"{p}.post_attention_layernorm.weight", (hidden,)),
            (f"{p}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{p}.mlp.up_proj.weight", (inter, hidden)),
            (f"{p}.mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    generator = torch.Generator().manual_seed(a["seed"])
    dtype = _TORCH_DTYPES[a["dtype"]]
    tensors = {}
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.float32)
        else:
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, a["std"], generator=generator)
        tensors[name] = t.to(dtype)
    return tensors


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
