"""``pearl trainer serve --model DIR --port P``: a trainer in a process of its own, its
``Trainer`` protocol over HTTP (``pearl.trainer.server``); ``pearl run`` starts one. The
reference trainer (torch, CPU) by default; ``--backend megatron`` Megatron-core's (CUDA:
refused in one line on a machine without a GPU), with ``--megatron FILE`` its options."""

from __future__ import annotations

import argparse
from pathlib import Path

from pearl.cli.flags import port
from pearl.io.documents import InputError, parse, read_document
from pearl.io.extras import require


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("trainer", help="the reference trainer as a server")
    trainer_sub = p.add_subparsers(dest="trainer_command", required=True)
    s = trainer_sub.add_parser(
        "serve", help="serve the reference trainer (GRPO on torch, CPU) over HTTP"
    )
    s.add_argument("--model", required=True, help="model directory (config.json, weights)")
    s.add_argument(
        "--config", default=None, help="a TrainerConfig file (JSON or YAML); default: its defaults"
    )
    s.add_argument("--backend", choices=("reference", "megatron"), default="reference")
    s.add_argument(
        "--megatron", default=None, help="MegatronOptions (JSON or YAML); default: its defaults"
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=port, default=8100)
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for module in ("torch", "fastapi", "uvicorn", "safetensors"):
        require(module)
    from pearl.trainer.config import TrainerConfig
    from pearl.trainer.server import serve

    if not Path(args.model).is_dir():
        raise InputError(args.model, "--model", "no such model directory")
    config = (
        parse(TrainerConfig, read_document(args.config), args.config)
        if args.config
        else TrainerConfig()
    )
    options = None
    if args.backend == "megatron":
        require("megatron")
        import torch

        from pearl.trainer.megatron.config import MegatronOptions

        if args.megatron:
            options = parse(MegatronOptions, read_document(args.megatron), args.megatron)
        if not torch.cuda.is_available():
            raise InputError("pearl trainer serve", "--backend megatron", "needs CUDA: no GPU here")
    elif args.megatron:
        raise InputError(args.megatron, "--megatron", "only with --backend megatron")
    return serve(Path(args.model), config, args.host, args.port, args.backend, options)
