"""Turn-cycle model of the batch-completion predictor (equations in ``docs/predictor.md``).

A live trajectory repeats a *turn cycle*: prefill of the turn's new tokens, KV transfer to
a decode instance (disaggregated only), decode of ``o`` output tokens, then an environment
step of ``e`` seconds. ``solve_cycle`` gives, for arrays of segments (``N`` live
trajectories of mean turn-start context ``C``), the cycle time

    T     = max(T_lat, T_prefill, T_decode, T_transfer)
    T_lat = l_p + x + o * tau(B) + e                       (one trajectory's own latency)
    B     = clip(1 + (N - 1) * o * tau(B) / (T * D), 1, B_max)   (decode batch, fixed point)

where ``tau(B)`` is the capacity-weighted decode step time at per-instance batch ``B``
(plus, on colocated instances, the chunked prefill of the other sequences' turns) and
the ``T_*`` terms are the throughput bounds of the prefill pool, the decode pool (at
``B_max``, the slots that ``max_num_seqs`` and the KV cache allow) and the KV links.

Invariants: every returned array has the shape of ``num_live``; ``T >= T_lat >= env_s``;
``B == 1`` where ``N == 1``; ``T`` is ``+inf`` exactly where no decode instance can hold
one context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from pearl.core.pd import PDConfig
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import Role

F64 = NDArray[np.float64]
_TINY = 1e-12

# Binding term of a segment's cycle time, as codes into BOUND_NAMES.
LATENCY, PREFILL, DECODE, KV_TRANSFER, KV_CAPACITY = range(5)
BOUND_NAMES = ("latency", "prefill", "decode", "kv_transfer", "kv_capacity")


@dataclass(frozen=True)
class TurnShape:
    """Per-turn means of the workload."""

    output_tokens: float  # o: generated tokens per turn
    observation_tokens: float  # tokens the environment appends per turn
    env_s: float  # e: environment latency per turn

    @property
    def growth_tokens(self) -> float:
        """Context growth per turn: output plus observation."""
        return self.output_tokens + self.observation_tokens


@dataclass(frozen=True)
class EngineGroups:
    """A configuration's instances as coefficient columns of shape (G, 1).

    ``pf_*`` rows form the prefill pool (prefill and colocated groups), ``dec_*`` rows the
    decode pool (decode and colocated groups); a colocated group is a row of both.
    """

    disaggregated: bool  # some instance is a dedicated prefill or decode instance
    pf_count: F64  # instances
    pf_a_s: F64  # fixed cost of one prefill batch
    pf_b_s: F64  # cost per new token
    pf_c_s: F64  # attention cost per token pair
    pf_max_batched_tokens: F64
    dec_count: F64  # instances
    dec_colocated: F64  # 1 where prefill chunks share the decode steps
    dec_prefill_row: NDArray[np.intp]  # (G,) the group's prefill-pool row (0 if none)
    dec_small: tuple[F64, F64, F64]  # (base_s, per_seq_s, per_ctx_token_s), small batches
    dec_large: tuple[F64, F64, F64]  # the same from large_batch_from on
    dec_large_batch_from: F64
    dec_max_num_seqs: F64
    dec_kv_capacity_tokens: F64  # per instance
    num_prefill_instances: float
    kv_prefill_pool_tokens: float  # KV capacity of the whole prefill pool
    kv_decode_pool_tokens: float  # KV capacity of the whole decode pool
    kv_bytes_per_token: float
    link_instance_bytes_per_s: float  # one instance's KV link: min of the pools' means
    link_total_bytes_per_s: float  # all KV links: min of the pools' sums


def engine_groups(config: PDConfig, profile: RuntimeProfile) -> EngineGroups | None:
    """The groups of a configuration, or None when it cannot serve any trajectory.

    None when the configuration has no prefill-capable or no decode-capable instance, or
    a (gpu type, tp) without engine profile or KV capacity. Non-inference roles are ignored.
    """
    rows: list[tuple[float, ...]] = []
    roles: list[Role] = []
    for spec, num in config.instances:
        if spec.role not in (Role.PREFILL, Role.DECODE, Role.COLOCATED):
            continue
        e = profile.engine(spec.gpu_type, spec.tp)
        kv_tokens = profile.kv_capacity_tokens(spec.gpu_type, spec.tp)
        if e is None or kv_tokens <= 0:
            return None
        p, sm, lg = e.prefill, e.decode.small, e.decode.large
        link_bytes_per_s = spec.tp * profile.gpus[spec.gpu_type].kv_transfer_gb_per_s * 1e9
        roles.append(spec.role)
        rows.append((num, kv_tokens, link_bytes_per_s, p.a_s, p.b_s_per_token, p.c_s_per_token2))
        rows[-1] += (e.max_batched_tokens, spec.role is Role.COLOCATED, e.decode.large_batch_from)
        rows[-1] += (sm.base_s, sm.per_seq_s, sm.per_ctx_token_s)
        rows[-1] += (lg.base_s, lg.per_seq_s, lg.per_ctx_token_s, e.max_num_seqs)
    pf = [i for i, r in enumerate(roles) if r in (Role.PREFILL, Role.COLOCATED)]
    dec = [i for i, r in enumerate(roles) if r in (Role.DECODE, Role.COLOCATED)]
    if not pf or not dec:
        return None
    table = np.array(rows, dtype=float)
    p_cols, d_cols = table[pf].T[:, :, None], table[dec].T[:, :, None]  # column, group, 1

    def pool_sum(index: list[int], column: int | None = None) -> float:
        """Sum over a pool's instances of a column (of 1 when None)."""
        return sum(rows[i][0] * (1.0 if column is None else rows[i][column]) for i in index)

    pf_link, dec_link = pool_sum(pf, 2), pool_sum(dec, 2)
    return EngineGroups(
        disaggregated=any(r is not Role.COLOCATED for r in roles),
        pf_count=p_cols[0],
        pf_a_s=p_cols[3],
        pf_b_s=p_cols[4],
        pf_c_s=p_cols[5],
        pf_max_batched_tokens=p_cols[6],
        dec_count=d_cols[0],
        dec_colocated=d_cols[7],
        dec_prefill_row=np.array([pf.index(i) if i in pf else 0 for i in dec], dtype=np.intp),
        dec_small=(d_cols[9], d_cols[10], d_cols[11]),
        dec_large=(d_cols[12], d_cols[13], d_cols[14]),
        dec_large_batch_from=d_cols[8],
        dec_max_num_seqs=d_cols[15],
        dec_kv_capacity_tokens=d_cols[1],
        num_prefill_instances=pool_sum(pf),
        kv_prefill_pool_tokens=pool_sum(pf, 1),
        kv_decode_pool_tokens=pool_sum(dec, 1),
        kv_bytes_per_token=float(profile.model.kv_bytes_per_token),
        link_instance_bytes_per_s=min(pf_link / pool_sum(pf), dec_link / pool_sum(dec)),
        link_total_bytes_per_s=min(pf_link, dec_link),
    )


@dataclass(frozen=True)
class Segments:
    """Token quantities of segments, computed once per workload and PD mode."""

    num_live: F64  # N: live trajectories
    env_s: F64  # e: env latency of a turn (0 models a turn without env step)
    ctx_tokens: F64  # mean turn-start context, >= 1
    ctx_sq_tokens2: F64  # mean of its square (a full re-prefill costs c * ctx^2)
    new_tokens: F64  # tokens a turn prefills when its prefix is cached
    attention_tokens: F64  # 2 * prefix + new: prefill attention cost per new token / c
    kv_tokens: F64  # KV of a live trajectory, mid-decode: ctx + o/2
    live_kv_tokens: F64  # N * kv_tokens


def segments(
    turn: TurnShape,
    num_live: F64,
    ctx_tokens: F64,
    ctx_var_tokens2: F64,
    env_s: F64,
    disaggregated: bool,
) -> Segments:
    """Per-turn token quantities; a disaggregated prefill never saw the last output.

    ``ctx_var_tokens2`` is the variance of the live trajectories' contexts.
    """
    ctx = np.maximum(ctx_tokens, 1.0)
    new_tokens = turn.observation_tokens + (turn.output_tokens if disaggregated else 0.0)
    prefix = np.maximum(ctx - new_tokens, 0.0)
    kv_tokens = ctx + 0.5 * turn.output_tokens
    return Segments(
        num_live=num_live,
        env_s=env_s,
        ctx_tokens=ctx,
        ctx_sq_tokens2=ctx * ctx + np.maximum(ctx_var_tokens2, 0.0),
        new_tokens=ctx - prefix,
        attention_tokens=ctx + prefix,
        kv_tokens=kv_tokens,
        live_kv_tokens=num_live * kv_tokens,
    )


@dataclass(frozen=True)
class Cycle:
    """The turn cycle of each segment; every field has the segments' shape."""

    cycle_s: F64  # T: time for every live trajectory to advance one turn
    latency_s: F64  # T_lat: one trajectory's own prefill + transfer + decode + env
    throughput_s: F64  # max(T_prefill, T_decode, T_transfer): capacity bound on T
    bound: NDArray[np.intp]  # binding term, a code into BOUND_NAMES
    decode_batch: F64  # B: per-instance decode batch seen by a decoding sequence
    decode_slot_use: F64  # B / B_max
    prefill_s: F64  # l_p: prefill latency of one turn
    transfer_s: F64  # x: KV transfer latency of one turn (0 when colocated)
    decode_s: F64  # o * tau(B): decode latency of one turn
    prefix_hit: F64  # share of turns whose prefix is still cached on the prefill side
    prefill_use: F64  # busy share of the prefill pool


def solve_cycle(g: EngineGroups, turn: TurnShape, seg: Segments, num_iterations: int = 3) -> Cycle:
    """Cycle time of each segment (``seg`` must match ``g.disaggregated``).

    The decode-batch fixed point takes ``num_iterations`` tangent steps from B = 1: each
    linearises ``tau`` at the current batch and solves the resulting quadratic exactly,
    so one group in one batch regime converges in a single step.
    """
    n, o, ctx, new, kv_tokens = (
        seg.num_live,
        turn.output_tokens,
        seg.ctx_tokens,
        seg.new_tokens,
        seg.kv_tokens,
    )

    # Prefill. Prefix reuse drops when the live contexts overflow the pool's KV cache;
    # a miss re-prefills the whole context. b n + c((p + n)^2 - p^2) = n (b + c (2p + n)).
    hit = np.minimum(1.0, g.kv_prefill_pool_tokens / seg.live_kv_tokens)
    miss = 1.0 - hit
    work_miss = g.pf_b_s * ctx + g.pf_c_s * seg.ctx_sq_tokens2
    work = hit * new * (g.pf_b_s + g.pf_c_s * seg.attention_tokens) + miss * work_miss
    per_batch = np.minimum(
        np.maximum(g.pf_max_batched_tokens / (hit * new + miss * ctx), 1.0),
        np.maximum(n / g.num_prefill_instances, 1.0),
    )
    work_thr = np.maximum(work + g.pf_a_s / per_batch, _TINY)  # instance time per turn
    rate = g.pf_count / work_thr  # turns/s of each group when busy
    cap_p = rate.sum(axis=0)
    prefill_s = (rate * (g.pf_a_s + work)).sum(axis=0) / cap_p
    miss_share = miss * (rate * work_miss).sum(axis=0) / g.num_prefill_instances

    # Decode slots: max_num_seqs or the sequences whose KV fits, whichever is fewer.
    fit = g.dec_kv_capacity_tokens / kv_tokens
    fits = fit >= 1.0
    b_max = fits * np.minimum(g.dec_max_num_seqs, fit)
    n_dec = fits * g.dec_count
    num_dec = n_dec.sum(axis=0)
    feasible = num_dec > 0
    num_dec = np.maximum(num_dec, _TINY)
    b_max_mean = np.maximum((n_dec * b_max).sum(axis=0) / num_dec, 1.0)
    kv_limited = (n_dec * fit).sum(axis=0) < (n_dec * g.dec_max_num_seqs).sum(axis=0)
    # Colocated: each step also carries the chunked prefills of the other sequences.
    inter = g.dec_colocated * work_thr[g.dec_prefill_row] / o
    per_seq_small = g.dec_small[1] + g.dec_small[2] * kv_tokens + inter
    per_seq_step = g.dec_large[1] + g.dec_large[2] * kv_tokens + inter - per_seq_small
    base_small = g.dec_small[0] - inter
    base_step = g.dec_large[0] - g.dec_small[0]
    single = n_dec.shape[0] == 1

    def step(batch: F64) -> tuple[F64, F64]:
        """Per-group step time at per-instance batch ``batch`` and its slope in batch."""
        b = np.minimum(batch, b_max)
        large = b >= g.dec_large_batch_from
        per_seq = per_seq_small + large * per_seq_step
        tau = np.maximum(base_small + large * base_step + b * per_seq, _TINY)
        return tau, per_seq * (batch < b_max)

    def step_mean(batch: F64) -> tuple[F64, F64]:
        """Capacity-weighted (harmonic) mean step time over groups, and its slope."""
        tau, slope = step(batch)
        if single:
            return tau[0], slope[0]
        weight = n_dec / tau
        tau_mean = num_dec / np.maximum(weight.sum(axis=0), _TINY)
        return tau_mean, tau_mean**2 / num_dec * (weight * slope / tau).sum(axis=0)

    tau_sat, _ = step(np.full_like(n, np.inf))
    slots = n_dec * b_max
    decode_rate = (slots / tau_sat).sum(axis=0)  # tokens/s with every slot busy
    pure_sat = np.maximum(tau_sat - inter * (b_max - 1.0), _TINY)
    pure_rate = (slots / pure_sat).sum(axis=0)  # the same without prefill chunks
    t_decode = n * o / np.maximum(decode_rate, _TINY)
    t_prefill = n / cap_p
    if g.disaggregated:
        hit_d = np.minimum(1.0, g.kv_decode_pool_tokens / seg.live_kv_tokens)
        transfer_bytes = g.kv_bytes_per_token * (hit_d * new + (1.0 - hit_d) * ctx)
        transfer_s = transfer_bytes / g.link_instance_bytes_per_s
        t_transfer = n * transfer_bytes / g.link_total_bytes_per_s
        t_bound = np.maximum(np.maximum(t_prefill, t_decode), t_transfer)
    else:
        transfer_s = t_transfer = np.zeros_like(n)
        t_bound = np.maximum(t_prefill, t_decode)
    fixed_s = prefill_s + transfer_s + seg.env_s
    m = (n - 1.0) / num_dec
    m_per_bound = m / np.maximum(t_bound, _TINY)

    batch = np.ones_like(n)
    for _ in range(num_iterations):
        tau, slope = step_mean(batch)
        ob = o * slope  # tangent of o * tau at the current batch: oa + ob * B
        oa = np.maximum(o * tau - ob * batch, 0.0)
        fixed_oa = fixed_s + oa
        # Latency-bound: (B - 1)(A + oa + ob B) = m (oa + ob B); its positive root.
        c0 = fixed_oa + oa * m
        c1 = fixed_oa - ob * (1.0 + m)
        root = np.sqrt(c1 * c1 + 4.0 * ob * c0)
        b_lat = np.where(
            c1 >= 0.0,
            2.0 * c0 / np.maximum(c1 + root, _TINY),
            (root - c1) / np.maximum(2.0 * ob, _TINY),
        )
        # Throughput-bound: B - 1 = m (oa + ob B) / T_bound (no root: B runs to B_max).
        b_thr = (1.0 + m_per_bound * oa) / np.maximum(1.0 - m_per_bound * ob, _TINY)
        b = np.where(fixed_oa + ob * b_lat >= t_bound, b_lat, b_thr)
        batch = np.minimum(np.maximum(b, 1.0), b_max_mean)

    tau, _ = step_mean(batch)
    decode_s = o * tau
    latency_s = fixed_s + decode_s
    cycle_s = np.where(feasible, np.maximum(latency_s, t_bound), np.inf)
    # The binding term. A saturated decode pool is KV-bound when the KV cache, not
    # max_num_seqs, limits its slots, and prefill-bound when (colocated) prefill chunks
    # take most of each step; a prefill pool is KV-bound when most of its work re-prefills
    # contexts evicted from the prefix cache.
    capacity = np.where(
        t_decode >= np.maximum(t_prefill, t_transfer),
        np.where(kv_limited, KV_CAPACITY, np.where(pure_rate > 2 * decode_rate, PREFILL, DECODE)),
        np.where(t_prefill >= t_transfer, PREFILL, KV_TRANSFER),
    )
    capacity = np.where((capacity == PREFILL) & (miss_share > 0.5), KV_CAPACITY, capacity)
    bound = np.where(latency_s >= t_bound, LATENCY, capacity)
    return Cycle(
        cycle_s=cycle_s,
        latency_s=latency_s,
        throughput_s=t_bound,
        bound=bound,
        decode_batch=batch,
        decode_slot_use=batch / b_max_mean,
        prefill_s=prefill_s,
        transfer_s=transfer_s,
        decode_s=decode_s,
        prefix_hit=hit,
        prefill_use=np.minimum(n / (cycle_s * cap_p), 1.0),
    )
