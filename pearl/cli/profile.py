"""``pearl profile fit``: fit a runtime profile to a sweep against a running engine."""

from __future__ import annotations

import argparse
import json

from pearl.cli.bench import int_list
from pearl.cli.flags import integer
from pearl.core.limits import MAX_TOKENS
from pearl.io.documents import InputError
from pearl.io.extras import require


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("profile", help="runtime profiles from measurements")
    which = p.add_subparsers(dest="profile_command", required=True)
    f = which.add_parser("fit", help="sweep a running engine and fit a runtime profile")
    f.add_argument("--engine", required=True, help="engine URL, http://HOST:PORT")
    f.add_argument("--out", required=True, help="profile file to write (YAML)")
    f.add_argument("--batch-sizes", default="1,4,16,32", help="concurrent requests, comma list")
    f.add_argument("--context-tokens", default="64,256,1024", help="prompt tokens, comma list")
    f.add_argument(
        "--holdout",
        default=None,
        help="sweep points BxL left out of the fit, comma list (default: every third point)",
    )
    f.add_argument(
        "--decode-tokens", type=integer(1, 1_000_000), default=8, help="decode steps per point"
    )
    f.add_argument("--model", default=None, help="model directory (default: the engine's root)")
    f.add_argument("--gpu-type", default="cpu", help="the profile's key for this hardware")
    f.add_argument("--base", default="qwen3-8b", help="profile to copy costs/workload from")
    f.add_argument(
        "--max-num-seqs", type=integer(1, 1_000_000), default=64, help="the engine's --max-num-seqs"
    )
    f.add_argument(
        "--max-num-batched-tokens",
        type=integer(1, MAX_TOKENS),
        default=512,
        help="the engine's flag of that name",
    )
    f.add_argument(
        "--kv-cache-tokens", type=integer(1, MAX_TOKENS), default=65536, help="the engine's flag"
    )
    f.add_argument("--json", action="store_true", help="print only the JSON object")
    f.set_defaults(run=_run_fit)


def _run_fit(args: argparse.Namespace) -> int:
    batches = int_list(args.batch_sizes, "--batch-sizes")
    contexts = int_list(args.context_tokens, "--context-tokens")
    holdout = None
    if args.holdout is not None:
        holdout = tuple(x.strip() for x in args.holdout.split(",") if x.strip())
    limits = (args.decode_tokens, args.max_num_seqs, args.max_num_batched_tokens)
    if min(limits) < 2 or args.kv_cache_tokens < 1:
        raise InputError("<command line>", "--decode-tokens/--max-num-*", "need >= 2")
    require("prometheus_client")  # the engine client parses /metrics with it
    from pearl.bench.profile_fit import fit_profile

    result = fit_profile(
        args.engine,
        args.out,
        batches,
        contexts,
        holdout,
        decode_tokens=args.decode_tokens,
        model_dir=args.model,
        gpu_type=args.gpu_type,
        base=args.base,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_num_batched_tokens,
        kv_capacity_tokens=args.kv_cache_tokens,
    )
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
