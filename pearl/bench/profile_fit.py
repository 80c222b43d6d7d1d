"""``pearl profile fit``: a runtime profile fitted to a sweep against a running engine.

The profile's cost model (``pearl.core.profile``, ``docs/predictor.md``) has two parts: the
time of one prefill batch as a function of its sequences' new tokens, and the time of one
decode step as a function of the batch size ``B`` and the context ``K`` the batch holds.
Each sweep point (``B`` concurrent requests with prompts of ``L`` tokens) gives one record
of each:

- prefill: the ``B`` prompts sent at once with ``max_tokens: 1``; the wall time until the
  last answer is the batch's time, a ``PrefillRecord`` of ``B`` sequences of ``L`` new
  tokens. Measured here, not from the engine's ``vllm:request_prefill_time_seconds``:
  that histogram times each request from its own first scheduling, so under chunked
  prefill its mean is not the batch's time (the profile's unit). The wall time includes
  the HTTP round trip of ``B`` requests (small against a prefill, not nothing for ``B = 1``
  and short prompts).
- decode: the same prompts again, now found in the engine's prefix cache (their KV was
  just computed), with ``decode_tokens`` tokens and ``ignore_eos``; the engine's own
  ``vllm:inter_token_latency_seconds`` sum and count over the point (deltas of
  ``/metrics``) give the mean time between two tokens of a sequence, which with all ``B``
  decoding together is the time of one decode step: a ``DecodeRecord`` with ``B`` and
  ``K = B * (L + decode_tokens / 2)``, the mean context over the point's steps. Server-side
  and exact (a sum, not buckets), without the HTTP overhead of streaming each token. The
  prefix-cache hit share of the decode requests is reported: without a prefix cache the
  decode steps would share time with re-prefills.

The records of the points not held out are fitted with
``pearl.core.fitting.fit_engine_profile_with_report``; the held-out points are predicted
with the fitted coefficients and their absolute percentage errors reported (MAPE per
quantity). The profile is written as YAML in the format of ``pearl/profiles/*.yaml``; the
model section comes from the model's ``config.json`` and weight files, the engine limits
from the options (the engine's own flags, same defaults), and the transition costs and
workload defaults from a base profile (``--base``, not measured here): the header of the
written file says which numbers are measured.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pearl.bench.engine_proc import random_prompts
from pearl.core.fitting import DecodeRecord, PrefillRecord, fit_engine_profile_with_report
from pearl.core.profile import EngineProfile, GpuProfile, ModelSpec, RuntimeProfile
from pearl.engines.client import EngineClient
from pearl.io.documents import InputError, load_profile

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class SweepPoint:
    batch: int
    ctx: int
    prefill_s: float
    decode_step_s: float
    decode_ctx_tokens: int
    prefix_hit_share: float

    @property
    def key(self) -> str:
        return f"{self.batch}x{self.ctx}"

    def prefill_record(self) -> PrefillRecord:
        return PrefillRecord((self.ctx,) * self.batch, (0,) * self.batch, self.prefill_s)

    def decode_record(self) -> DecodeRecord:
        return DecodeRecord(self.batch, self.decode_ctx_tokens, self.decode_step_s)


def default_holdout(batches: tuple[int, ...], contexts: tuple[int, ...]) -> tuple[str, ...]:
    """Every third point of the grid on a diagonal pattern (``(i + j) % 3 == 1``), so that
    held-out points lie among fitted ones in both directions."""
    return tuple(
        f"{b}x{c}"
        for i, b in enumerate(batches)
        for j, c in enumerate(contexts)
        if (i + j) % 3 == 1
    )


def fit_profile(
    engine_url: str,
    out: str | Path,
    batches: tuple[int, ...] = (1, 4, 16, 32),
    contexts: tuple[int, ...] = (64, 256, 1024),
    holdout: tuple[str, ...] | None = None,
    *,
    decode_tokens: int = 8,
    model_dir: str | Path | None = None,
    gpu_type: str = "cpu",
    base: str = "qwen3-8b",
    max_num_seqs: int = 64,
    max_batched_tokens: int = 512,
    kv_capacity_tokens: int = 65536,
) -> dict[str, Any]:
    grid = [f"{b}x{c}" for b in batches for c in contexts]
    held = default_holdout(batches, contexts) if holdout is None else holdout
    unknown = sorted(set(held) - set(grid))
    if unknown:
        raise InputError("<command line>", "--holdout", f"not sweep points: {', '.join(unknown)}")
    base_profile = load_profile(base)  # before the sweep: a bad name fails fast
    t0 = time.monotonic()
    points, root = asyncio.run(_sweep(engine_url, batches, contexts, decode_tokens))
    sweep_s = time.monotonic() - t0
    fit_pts = [p for p in points if p.key not in held]
    test_pts = [p for p in points if p.key in held]
    try:
        engine, report = fit_engine_profile_with_report(
            [p.prefill_record() for p in fit_pts],
            [p.decode_record() for p in fit_pts],
            tp=1,
            max_num_seqs=max_num_seqs,
            max_batched_tokens=max_batched_tokens,
            kv_capacity_tokens=kv_capacity_tokens,
        )
    except ValueError as err:
        raise InputError(
            "<command line>", "--batch-sizes/--context-tokens/--holdout", str(err)
        ) from None
    spec = _model_spec(Path(model_dir) if model_dir else Path(root))
    profile = RuntimeProfile(
        model=spec,
        gpus={gpu_type: _gpu(engine)},
        costs=base_profile.costs,
        workload=base_profile.workload,
    )
    _write(profile, Path(out), engine_url, batches, contexts, held, decode_tokens, base)
    held_out = [_error(engine, p) for p in test_pts]
    return {
        "engine": engine_url,
        "out": str(out),
        "sweep_s": round(sweep_s, 2),
        "decode_tokens": decode_tokens,
        "fitted_points": [p.key for p in fit_pts],
        "held_out_points": [p.key for p in test_pts],
        "fit": report.as_dict(),
        "held_out": held_out,
        "held_out_mape": {
            "prefill": _mean([h["prefill_ape"] for h in held_out]),
            "decode_step": _mean([h["decode_step_ape"] for h in held_out]),
        },
        "coefficients": engine.model_dump(mode="json"),
        "points": [vars(p) for p in points],
    }


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _error(engine: EngineProfile, p: SweepPoint) -> dict[str, Any]:
    rec = p.prefill_record()
    pred_prefill = engine.prefill.batch_s(rec.new_tokens, rec.prefix_tokens)
    pred_decode = float(engine.decode.step_s(p.batch, p.decode_ctx_tokens))
    return {
        "point": p.key,
        "prefill_s": round(p.prefill_s, 5),
        "prefill_pred_s": round(pred_prefill, 5),
        "prefill_ape": round(abs(pred_prefill - p.prefill_s) / p.prefill_s, 4),
        "decode_step_s": round(p.decode_step_s, 6),
        "decode_step_pred_s": round(pred_decode, 6),
        "decode_step_ape": round(abs(pred_decode - p.decode_step_s) / p.decode_step_s, 4),
    }


async def _sweep(
    url: str, batches: tuple[int, ...], contexts: tuple[int, ...], decode_tokens: int
) -> tuple[list[SweepPoint], str]:
    async with EngineClient(url, timeout_s=600.0) as client:
        card = (await client.models())["data"][0]
        name, root = str(card["id"]), str(card.get("root") or "")
        vocab = _vocab(root)
        warm = random_prompts(2, 32, vocab, seed=7)
        await asyncio.gather(*(client.completions(_body(name, p, 4)) for p in warm))
        points = []
        for i, b in enumerate(batches):
            for j, c in enumerate(contexts):
                prompts = random_prompts(b, c, vocab, seed=10_000 + 100 * i + j)
                points.append(await _point(client, name, prompts, decode_tokens))
    return points, root


async def _point(
    client: EngineClient, name: str, prompts: list[list[int]], decode_tokens: int
) -> SweepPoint:
    b, c = len(prompts), len(prompts[0])
    t0 = time.perf_counter()
    await asyncio.gather(*(client.completions(_body(name, p, 1)) for p in prompts))
    prefill_s = time.perf_counter() - t0
    before = await client.metrics()
    # decode_tokens + 1 tokens: the first comes from the (cached) prefill, the rest are
    # decode_tokens steps, each an inter-token latency.
    await asyncio.gather(*(client.completions(_body(name, p, decode_tokens + 1)) for p in prompts))
    after = await client.metrics()

    def delta(metric: str) -> float:
        return after.get(metric, 0.0) - before.get(metric, 0.0)

    count = delta("vllm:inter_token_latency_seconds_count")
    if count <= 0:
        raise RuntimeError(f"point {b}x{c}: the engine recorded no inter-token latency")
    queries = delta("vllm:prefix_cache_queries_total")
    return SweepPoint(
        batch=b,
        ctx=c,
        prefill_s=prefill_s,
        decode_step_s=delta("vllm:inter_token_latency_seconds_sum") / count,
        decode_ctx_tokens=round(b * (c + decode_tokens / 2)),
        prefix_hit_share=round(delta("vllm:prefix_cache_hits_total") / queries, 4)
        if queries > 0
        else 0.0,
    )


def _body(name: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def _vocab(root: str) -> int:
    path = Path(root) / "config.json"
    try:
        return int(json.loads(path.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return 512  # ids below 512 exist in every vocabulary pearl serves


def _model_spec(model_dir: Path) -> ModelSpec:
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(path, "config.json", f"cannot be read ({err}); pass --model DIR") from None
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or model_dir.name),
        num_layers=int(cfg["num_hidden_layers"]),
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        kv_dtype_bytes=DTYPE_BYTES.get(dtype, 4),
        weights_gb=max(weights / 1e9, 1e-6),
    )


def _gpu(engine: EngineProfile) -> GpuProfile:
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        memory_gb = 1.0
    return GpuProfile(
        memory_gb=memory_gb,
        kv_transfer_gb_per_s=1.0,
        kv_transfer_intra_node_gb_per_s=1.0,
        engines=(engine,),
    )


def _write(
    profile: RuntimeProfile,
    out: Path,
    url: str,
    batches: tuple[int, ...],
    contexts: tuple[int, ...],
    held: tuple[str, ...],
    decode_tokens: int,
    base: str,
) -> None:
    header = [
        "# Runtime profile fitted by `pearl profile fit` (pearl.bench.profile_fit):",
        "# pearl.core.profile.RuntimeProfile, schema version 1.",
        f"# Engine {url}; sweep batch sizes {list(batches)} x prompt tokens {list(contexts)},",
        f"# {decode_tokens} decode tokens per request; held out of the fit: {list(held)}.",
        "# MEASURED: engines[0].prefill and engines[0].decode (pearl.core.fitting).",
        "# GIVEN (the engine's flags): max_num_seqs, max_batched_tokens, kv_capacity_tokens.",
        "# FROM THE MODEL FILES: model (config.json; weights_gb = safetensors bytes / 1e9).",
        "# NOT MEASURED: memory_gb (host memory), kv_transfer_*_gb_per_s (1.0 placeholders),",
        f"# costs and workload (copied from the profile {base!r}).",
    ]
    data = profile.model_dump(mode="json")
    text = "\n".join(header) + "\n\n" + yaml.safe_dump(data, sort_keys=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
