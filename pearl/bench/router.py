"""``pearl bench router``: what the router costs per turn, and a live P:D change under load.

**Overhead.** Two reference engines on loopback serve the same sequence of short greedy
turns (``max_tokens`` small, so the engine's own time is small and the router's shows) in
turns: directly through the engine client, and through the router (colocated). Per turn
the wall time is taken; the router's overhead is the difference of the two distributions'
quantiles (p50, p99) — same turns, same engines, alternated in rounds so that outside load
falls on both alike. The issue's target is p99 <= 2 ms.

**P:D change under load.** ``trajectories`` trajectories run turns in a loop through the
router while the plan turns the two colocated instances into a prefill and a decode one
(drain, switch) and back; reported: trajectories lost (a turn that raised), turns per
second in each phase, how long each switch took, and the dip as the longest time around
each switch in which no turn finished.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pearl.bench.engine_proc import EngineProcess, random_prompts
from pearl.control.workers import free_port
from pearl.core.roles import Role
from pearl.engines.client import EngineClient
from pearl.router.router import Router, Sampling, Turn


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def _direct(c: EngineClient, prompt: list[int], max_tokens: int) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body |= {"ignore_eos": True, "logprobs": 0, "return_token_ids": True}
    t = time.perf_counter()
    await c.completions(body)
    return time.perf_counter() - t


async def _routed(r: Router, traj: str, prompt: list[int], max_tokens: int) -> float:
    sampling = Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    await r.generate(Turn(traj, tuple(prompt), sampling))
    return time.perf_counter() - t


async def _overhead(urls: list[str], turns: int, max_tokens: int, vocab: int) -> dict[str, Any]:
    prompts = random_prompts(turns, 32, vocab, seed=1)
    r = Router()
    for i, url in enumerate(urls):
        r.table.serve(f"e{i}", url, Role.COLOCATED)
    direct: list[float] = []
    routed: list[float] = []
    clients = [EngineClient(u) for u in urls]
    try:
        for c in clients:  # warm both paths (connections, first compiles)
            await _direct(c, prompts[0], max_tokens)
        await _routed(r, "warm", prompts[0], max_tokens)
        for i, prompt in enumerate(prompts):
            # the router sends trajectory i to its least-loaded instance (alternating,
            # like the direct calls below); one turn per trajectory, nothing cached
            routed.append(await _routed(r, f"t{i}", prompt, max_tokens))
            direct.append(await _direct(clients[i % len(clients)], prompt[::-1], max_tokens))
    finally:
        for c in clients:
            await c.aclose()
        await r.aclose()
    ms = 1000.0
    p50 = (_quantile(routed, 0.5) - _quantile(direct, 0.5)) * ms
    p99 = (_quantile(routed, 0.99) - _quantile(direct, 0.99)) * ms
    return {
        "turns": turns,
        "max_tokens": max_tokens,
        "direct_ms": {"p50": _quantile(direct, 0.5) * ms, "p99": _quantile(direct, 0.99) * ms},
        "routed_ms": {"p50": _quantile(routed, 0.5) * ms, "p99": _quantile(routed, 0.99) * ms},
        "overhead_ms": {
            "p50": p50,
            "p99": p99,
            "mean": (statistics.mean(routed) - statistics.mean(direct)) * ms,
        },
        "target_p99_ms": 2.0,
        "target_met": p99 <= 2.0,
    }


async def _pd_change(
    urls: list[str], trajectories: int, phase_s: float, vocab: int
) -> dict[str, Any]:
    r = Router()
    for i, url in enumerate(urls):
        r.table.serve(f"e{i}", url, Role.COLOCATED)
    done_at: list[float] = []
    failed: list[str] = []
    stop = asyncio.Event()
    sampling = Sampling(max_tokens=16, temperature=0.0, ignore_eos=True)

    async def trajectory(k: int) -> None:
        prompt = random_prompts(1, 24, vocab, seed=100 + k)[0]
        while not stop.is_set():
            try:
                out = await r.generate(Turn(f"m{k}", tuple(prompt), sampling))
            except Exception as err:  # a lost turn: the benchmark counts it
                failed.append(f"m{k}: {err}")
                return
            done_at.append(time.monotonic())
            prompt = [*prompt, *out.token_ids, 7][-400:]

    tasks = [asyncio.ensure_future(trajectory(k)) for k in range(trajectories)]
    t0 = time.monotonic()
    try:
        await asyncio.sleep(phase_s)
        t1 = time.monotonic()
        for wid, role in (("e0", Role.PREFILL), ("e1", Role.DECODE)):
            await r.drain(wid, timeout_s=60)
            r.table.switch(wid, role)
        t2 = time.monotonic()
        await asyncio.sleep(phase_s)
        t3 = time.monotonic()
        for wid in ("e1", "e0"):
            await r.drain(wid, timeout_s=60)
            r.table.switch(wid, Role.COLOCATED)
        t4 = time.monotonic()
        await asyncio.sleep(phase_s)
        t5 = time.monotonic()
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await r.aclose()

    def rate(a: float, b: float) -> float:
        return sum(1 for t in done_at if a <= t < b) / max(b - a, 1e-9)

    def longest_gap(a: float, b: float) -> float:
        """The longest time without a finished turn around a switch."""
        times = [a, *sorted(t for t in done_at if a <= t <= b), b]
        return max(y - x for x, y in itertools.pairwise(times))

    margin = 0.5
    return {
        "trajectories": trajectories,
        "lost_trajectories": len(failed),
        "errors": failed[:5],
        "turns": len(done_at),
        "turns_per_s": {
            "colocated": rate(t0, t1),
            "disaggregated": rate(t2, t3),
            "colocated_again": rate(t4, t5),
        },
        "switch_s": {"to_pd": t2 - t1, "back": t4 - t3},
        "longest_gap_s": {  # no turn finished for this long around each switch
            "to_pd": longest_gap(t1 - margin, t2 + margin),
            "back": longest_gap(t3 - margin, t4 + margin),
        },
    }


def bench_router(
    turns: int = 200, max_tokens: int = 4, trajectories: int = 8, phase_s: float = 3.0
) -> dict[str, Any]:
    from pearl.engines.reference.tiny import init_model

    with tempfile.TemporaryDirectory(prefix="pearl-bench-router-") as tmp:
        model = init_model(Path(tmp) / "model")  # pearl model init's defaults
        c = json.loads((model / "config.json").read_text())
        written = {
            k: c[k]
            for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
        }
        vocab = int(c["vocab_size"])
        engines = [  # each with a KV side channel: either may be the prefill instance
            EngineProcess(model, kv_port=free_port(), engine_id=f"e{i}", threads=1, log_dir=tmp)
            for i in range(2)
        ]
        load_before = os.getloadavg()[0]
        try:
            for e in engines:
                e.start()
            for e in engines:
                e.wait_healthy()
            urls = [e.url for e in engines]
            overhead = asyncio.run(_overhead(urls, turns, max_tokens, vocab))
            change = asyncio.run(_pd_change(urls, trajectories, phase_s, vocab))
        finally:
            for e in engines:
                e.stop()
    return {
        "model": written,
        "cpu_count": os.cpu_count(),
        "load_avg_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "overhead": overhead,
        "pd_change": change,
    }
