"""``pearl model init --out DIR``: write a tiny Qwen3 in Hugging Face format, offline.

Prints one JSON line: the directory, its parameter count and its files. Needs the engine
extra (torch, safetensors, tokenizers), imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json

from pearl.cli.flags import integer, number
from pearl.core.limits import MAX_TOKENS
from pearl.io.extras import require


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("model", help="model files for the reference engine")
    model_sub = p.add_subparsers(dest="model_command", required=True)
    init = model_sub.add_parser(
        "init", help="write a tiny random Qwen3 (weights, config, tokenizer) to a directory"
    )
    init.add_argument("--out", required=True, help="the model directory to write")
    init.add_argument("--layers", type=integer(1, 1_024), default=2)
    init.add_argument("--hidden", type=integer(1, 65_536), default=64, help="hidden size")
    init.add_argument("--heads", type=integer(1, 1_024), default=4, help="attention heads")
    init.add_argument("--kv-heads", type=integer(1, 1_024), default=2, help="key/value heads")
    init.add_argument("--head-dim", type=integer(1, 4_096), help="default: hidden / heads")
    init.add_argument(
        "--intermediate", type=integer(1, 1_048_576), help="MLP size; default: 3 x hidden"
    )
    init.add_argument(
        "--vocab", type=integer(1, 10_000_000), default=512, help="vocabulary (embedding rows)"
    )
    init.add_argument("--max-position-embeddings", type=integer(1, MAX_TOKENS), default=4096)
    init.add_argument("--seed", type=integer(0, 2**32 - 1), default=0, help="of the random weights")
    init.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    init.add_argument(
        "--std",
        type=number(0.0, 10.0, low_open=True),
        default=0.3,
        help="of the random weights (0.3)",
    )
    init.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty directory not pearl's"
    )
    init.set_defaults(run=run_init)


def run_init(args: argparse.Namespace) -> int:
    for module in ("torch", "safetensors", "tokenizers"):
        require(module)
    from pearl.engines.reference.tiny import init_model
    from pearl.engines.reference.weights import read_weights

    path = init_model(
        args.out,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate=args.intermediate,
        vocab=args.vocab,
        max_position_embeddings=args.max_position_embeddings,
        seed=args.seed,
        dtype=args.dtype,
        std=args.std,
        overwrite=args.overwrite,
    )
    parameters = sum(t.numel() for t in read_weights(path).values())
    files = sorted(p.name for p in path.iterdir())
    print(json.dumps({"path": str(path.resolve()), "parameters": parameters, "files": files}))
    return 0
