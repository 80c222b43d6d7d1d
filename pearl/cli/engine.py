"""``pearl engine serve --model DIR --port P``: the CPU reference engine on vLLM's protocol."""

from __future__ import annotations

import argparse
from pathlib import Path

from pearl.cli.flags import integer, port, positive_seconds
from pearl.core.limits import MAX_TOKENS
from pearl.io.documents import InputError
from pearl.io.extras import require

_positive = integer(1, MAX_TOKENS)  # sizes: tokens, sequences, threads


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("engine", help="the CPU reference inference engine")
    engine_sub = p.add_subparsers(dest="engine_command", required=True)
    s = engine_sub.add_parser(
        "serve", help="serve a Hugging Face Qwen3/Qwen2/Llama directory over vLLM's HTTP routes"
    )
    s.add_argument("--model", required=True, help="model directory (config.json, weights)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=port, default=8000)
    s.add_argument("--kv-port", type=port, default=None, help="KV side channel for PD")
    s.add_argument("--engine-id", default="0", help="this instance's id (kv_transfer_params)")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-model-len", type=_positive, default=None)
    s.add_argument("--kv-cache-tokens", type=_positive, default=65536)
    s.add_argument("--block-size", type=_positive, default=16)
    s.add_argument("--max-num-seqs", type=_positive, default=64)
    s.add_argument("--max-num-batched-tokens", type=_positive, default=512)
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    s.add_argument("--threads", type=_positive, default=None, help="torch threads")
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument(
        "--kv-lease-s", type=positive_seconds, default=30.0, help="how long a prefill's KV waits"
    )
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for module in ("torch", "fastapi", "uvicorn", "safetensors", "tokenizers"):
        require(module)
    from pearl.engines.reference.instance import ServeOptions
    from pearl.engines.reference.serve import serve

    if not Path(args.model).is_dir():
        raise InputError(args.model, "--model", "no such model directory")
    return serve(
        ServeOptions(
            model=args.model,
            host=args.host,
            port=args.port,
            kv_port=args.kv_port,
            engine_id=args.engine_id,
            served_model_name=args.served_model_name,
            max_model_len=args.max_model_len,
            kv_cache_tokens=args.kv_cache_tokens,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            dtype=args.dtype,
            threads=args.threads,
            prefix_caching=not args.no_prefix_caching,
            kv_lease_s=args.kv_lease_s,
        )
    )
