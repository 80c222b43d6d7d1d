"""Turn-cycle model of the batch-completion predictor (equations in ``docs/predictor.md``).

A live trajectory repeats a *turn cycle*: prefill of the turn's new tokens, KV transfer to
a decode instance (disaggregated only), decode of ``o`` output tokens, then an environment
step of ``e`` seconds. ``solve_cycle`` gives, for C configurations at once and arrays of
segments (``N`` live trajectories of mean turn-start context ``C``), the cycle time

    T     = max(T_lat, T_prefill, T_decode, T_transfer)
    T_lat = l_p + x + o * tau(B) + e                       (one trajectory's own latency)
    B     = clip(1 + (N - 1) * o * tau(B) / (T * D), 1, B_max)   (decode batch, fixed point)

where ``tau(B)`` is the capacity-weighted decode step time at per-instance batch ``B``
(plus, on colocated instances, the chunked prefill of the other sequences' turns) and
the ``T_*`` terms are the throughput bounds of the prefill pool, the decode pool (at
``B_max``, the slots that ``max_num_seqs`` and the KV cache allow) and the KV links.

Layout: the configurations' instance groups are flattened into *rows* of a prefill pool
and a decode pool (``EngineGroups``), shape (rows, 1); per-configuration results have
shape (C, S) for S segments. Sums over a configuration's rows are sequential in row
order, and nothing mixes configurations, so a configuration's result does not depend on
which other configurations share the call (bit for bit).

Invariants: every returned array has shape (C, S); ``T >= T_lat >= env_s``; ``B == 1``
where ``N == 1``; ``T`` is ``+inf`` exactly where no decode instance can hold one context.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

from pearl.core.engine_groups import F64, EngineGroups, Index, TurnShape

_TINY = 1e-12

# Binding term of a segment's cycle time, as codes into BOUND_NAMES.
LATENCY, PREFILL, DECODE, KV_TRANSFER, KV_CAPACITY = range(5)
BOUND_NAMES = ("latency", "prefill", "decode", "kv_transfer", "kv_capacity")


@dataclass(frozen=True)
class Segments:
    """Token quantities of segments (shape (S,)), computed once per workload.

    ``new_tokens`` and ``attention_tokens`` hold one array per PD mode: (colocated,
    disaggregated); a disaggregated prefill never saw the last output.
    """

    num_live: F64  # N: live trajectories
    env_s: F64  # e: env latency of a turn (0 models a turn without env step)
    ctx_tokens: F64  # mean turn-start context, >= 1
    ctx_sq_tokens2: F64  # mean of its square (a full re-prefill costs c * ctx^2)
    new_tokens: tuple[F64, F64]  # tokens a turn prefills when its prefix is cached
    attention_tokens: tuple[F64, F64]  # 2 * prefix + new: prefill attention per new token / c
    kv_tokens: F64  # KV of a live trajectory, mid-decode: ctx + o/2
    live_kv_tokens: F64  # N * kv_tokens


def segments(
    turn: TurnShape, num_live: F64, ctx_tokens: F64, ctx_var_tokens2: F64, env_s: F64
) -> Segments:
    """Per-turn token quantities; ``ctx_var_tokens2`` is the variance of the contexts."""
    ctx = np.maximum(ctx_tokens, 1.0)
    by_mode = []
    for new_tokens in (turn.observation_tokens, turn.growth_tokens):
        prefix = np.maximum(ctx - new_tokens, 0.0)
        by_mode.append((ctx - prefix, ctx + prefix))
    kv_tokens = ctx + 0.5 * turn.output_tokens
    return Segments(
        num_live=num_live,
        env_s=env_s,
        ctx_tokens=ctx,
        ctx_sq_tokens2=ctx * ctx + np.maximum(ctx_var_tokens2, 0.0),
        new_tokens=(by_mode[0][0], by_mode[1][0]),
        attention_tokens=(by_mode[0][1], by_mode[1][1]),
        kv_tokens=kv_tokens,
        live_kv_tokens=num_live * kv_tokens,
    )


@dataclass(frozen=True)
class CycleDetail:
    """What binds and how busy the pools are; every field has shape (C, S)."""

    bound: NDArray[np.intp]  # binding term, a code into BOUND_NAMES
    decode_slot_use: F64  # B / B_max
    prefix_hit: F64  # share of turns whose prefix is still cached on the prefill side
    prefill_use: F64  # busy share of the prefill pool


@dataclass(frozen=True)
class Cycle:
    """The turn cycle of each configuration and segment; every array has shape (C, S)."""

    cycle_s: F64  # T: time for every live trajectory to advance one turn
    latency_s: F64  # T_lat: one trajectory's own prefill + transfer + decode + env
    throughput_s: F64  # max(T_prefill, T_decode, T_transfer): capacity bound on T
    decode_batch: F64  # B: per-instance decode batch seen by a decoding sequence
    prefill_s: F64  # l_p: prefill latency of one turn
    transfer_s: F64  # x: KV transfer latency of one turn (0 when colocated)
    decode_s: F64  # o * tau(B): decode latency of one turn
    env_gap_s: F64 | None  # T minus T without env steps (>= 0), if asked for
    detail: CycleDetail | None  # if asked for


def _by_mode(g: EngineGroups, per_mode: tuple[F64, F64]) -> F64:
    """A segment quantity that depends on the PD mode: (S,) if one mode, else (C, S)."""
    if g.disaggregated.all():
        return per_mode[1]
    if not g.disaggregated.any():
        return per_mode[0]
    return np.where(g.disaggregated, per_mode[1], per_mode[0])


def solve_cycle(
    g: EngineGroups,
    turn: TurnShape,
    seg: Segments,
    num_iterations: int = 3,
    without_env: bool = False,
    detail: bool = True,
) -> Cycle:
    """Cycle time of each configuration and segment.

    The decode-batch fixed point takes ``num_iterations`` tangent steps from B = 1: each
    linearises ``tau`` at the current batch and solves the resulting quadratic exactly,
    so one group in one batch regime converges in a single step. Where every segment has
    N = 1 the fixed point is B = 1 and ``num_iterations=0`` gives it without rounding. With
    ``without_env`` the cycle of the same segments with no env step is solved as well, for
    the time the env steps add (``Cycle.env_gap_s``), sharing everything but the fixed
    point. ``detail=False`` leaves out ``Cycle.detail`` (what binds, utilisations).
    """
    n, o, ctx, kv_tokens = seg.num_live, turn.output_tokens, seg.ctx_tokens, seg.kv_tokens
    new, attention = _by_mode(g, seg.new_tokens), _by_mode(g, seg.attention_tokens)

    # Prefill. Prefix reuse drops where an instance's share of the live contexts overflows
    # its KV cache; a miss re-prefills the whole context. b n + c((p + n)^2 - p^2) =
    # n (b + c (2p + n)).
    hit_r = _hit_share(
        g.pf_kv_capacity_tokens, g.pf_spread(seg.live_kv_tokens / g.num_prefill_instances)
    )
    hit = g.pf_sum(g.pf_count * hit_r) / g.num_prefill_instances
    miss_r, new_r = 1.0 - hit_r, g.pf_spread(new)
    work_miss = g.pf_b_s * ctx + g.pf_c_s * seg.ctx_sq_tokens2
    work = hit_r * new_r * (g.pf_b_s + g.pf_c_s * g.pf_spread(attention)) + miss_r * work_miss
    per_batch = np.minimum(
        np.maximum(g.pf_max_batched_tokens / np.maximum(hit_r * new_r + miss_r * ctx, _TINY), 1.0),
        g.pf_spread(np.maximum(n / g.num_prefill_instances, 1.0)),
    )
    work_thr = np.maximum(work + g.pf_a_s / per_batch, _TINY)  # instance time per turn
    rate = g.pf_count / work_thr  # turns/s of each group when busy
    cap_p = g.pf_sum(rate)
    prefill_s = g.pf_sum(rate * (g.pf_a_s + work)) / cap_p

    # Decode slots: max_num_seqs or the sequences whose KV fits, whichever is fewer.
    fit = g.dec_kv_capacity_tokens / kv_tokens
    fits = fit >= 1.0
    b_max = np.where(fits, np.minimum(g.dec_max_num_seqs, fit), 0.0)
    n_dec = fits * g.dec_count
    num_dec = g.dec_sum(n_dec)
    feasible = num_dec > 0
    num_dec = np.maximum(num_dec, _TINY)
    b_max_mean = np.maximum(g.dec_sum(n_dec * b_max) / num_dec, 1.0)
    # Colocated: each step also carries the chunked prefills of the other sequences.
    inter = g.dec_colocated * np.take(work_thr, g.dec_prefill_row, axis=0) / o
    step = _DecodeStep.of(g, kv_tokens, inter, b_max, n_dec, num_dec)

    tau_sat, _ = step.rows(np.asarray(np.inf))
    slots = n_dec * b_max
    decode_rate = g.dec_sum(slots / tau_sat)  # tokens/s with every slot busy
    t_decode = n * o / np.maximum(decode_rate, _TINY)
    t_prefill = n / cap_p
    if g.disaggregated.any():
        live_d = g.dec_spread(seg.live_kv_tokens / g.num_decode_instances)
        hit_d = g.dec_sum(g.dec_count * _hit_share(g.dec_kv_capacity_tokens, live_d))
        hit_d = hit_d / g.num_decode_instances
        transfer_bytes = g.kv_bytes_per_token * (hit_d * new + (1.0 - hit_d) * ctx)
        transfer_s = transfer_bytes / g.link_instance_bytes_per_s * g.disaggregated
        t_transfer = n * transfer_bytes / g.link_total_bytes_per_s * g.disaggregated
        t_bound = np.maximum(np.maximum(t_prefill, t_decode), t_transfer)
    else:
        transfer_s = t_transfer = np.zeros_like(t_prefill)
        t_bound = np.maximum(t_prefill, t_decode)
    m = (n - 1.0) / num_dec
    batching = _Batching(
        step=step,
        own_s=prefill_s + transfer_s,
        others_per_instance=m,
        others_per_bound_s=m / np.maximum(t_bound, _TINY),
        throughput_s=t_bound,
        max_batch=b_max_mean,
    )
    batch, decode_s, latency_s = batching.solve(seg.env_s, o, num_iterations)
    cycle_s = np.where(feasible, np.maximum(latency_s, t_bound), np.inf)
    env_gap_s = None
    if without_env:
        # T - T_without_env is 0 where capacity binds (T_without_env >= T_bound = T), so
        # the fixed point without env steps runs only where latency binds.
        env_gap_s = np.zeros_like(cycle_s)
        binds = feasible & (latency_s > t_bound)
        if step.one_row:
            where = np.flatnonzero(binds)
            part = batching.subset(where, cycle_s.shape)
            latency_0_s = part.solve(0.0, o, num_iterations)[2]
            gap_s = cycle_s.ravel()[where] - np.maximum(latency_0_s, part.throughput_s)
            env_gap_s.ravel()[where] = np.maximum(gap_s, 0.0)
        else:
            latency_0_s = batching.solve(0.0, o, num_iterations)[2]
            gap_s = np.maximum(cycle_s - np.maximum(latency_0_s, t_bound), 0.0)
            env_gap_s = np.where(binds, gap_s, 0.0)
    cycle = Cycle(
        cycle_s=cycle_s,
        latency_s=latency_s,
        throughput_s=t_bound,
        decode_batch=batch,
        prefill_s=prefill_s,
        transfer_s=transfer_s,
        decode_s=decode_s,
        env_gap_s=env_gap_s,
        detail=None,
    )
    if not detail:
        return cycle
    # The binding term. A saturated decode pool is KV-bound when the KV cache, not
    # max_num_seqs, limits its slots, and prefill-bound when (colocated) prefill chunks
    # take most of each step; a prefill pool is KV-bound when most of its work re-prefills
    # contexts evicted from the prefix cache.
    kv_limited = g.dec_sum(n_dec * fit) < g.dec_sum(n_dec * g.dec_max_num_seqs)
    pure_sat = np.maximum(tau_sat - inter * (b_max - 1.0), _TINY)
    pure_rate = g.dec_sum(slots / pure_sat)  # decode rate without prefill chunks
    miss_share = g.pf_sum(miss_r * rate * work_miss) / g.num_prefill_instances
    capacity = np.where(
        t_decode >= np.maximum(t_prefill, t_transfer),
        np.where(kv_limited, KV_CAPACITY, np.where(pure_rate > 2 * decode_rate, PREFILL, DECODE)),
        np.where(t_prefill >= t_transfer, PREFILL, KV_TRANSFER),
    )
    capacity = np.where((capacity == PREFILL) & (miss_share > 0.5), KV_CAPACITY, capacity)
    return replace(
        cycle,
        detail=CycleDetail(
            bound=np.where(latency_s >= t_bound, LATENCY, capacity),
            decode_slot_use=batch / b_max_mean,
            prefix_hit=hit,
            prefill_use=np.minimum(n / (cycle_s * cap_p), 1.0),
        ),
    )


def _hit_share(kv_capacity_tokens: F64, live_kv_tokens: F64) -> F64:
    """The share of turns whose prefix an instance still holds: all while its share of
    the live contexts (``live_kv_tokens``, an even share: the router balances requests
    over instances) fits its KV cache, else the part that fits. Per instance, not per
    pool: a pool's spare KV on one instance keeps no prefix of another's trajectories."""
    result: F64 = np.minimum(1.0, kv_capacity_tokens / np.maximum(live_kv_tokens, _TINY))
    return result


@dataclass(frozen=True)
class _Batching:
    """Inputs of the decode-batch fixed point, per configuration and segment (C, S)."""

    step: _DecodeStep
    own_s: F64  # prefill + transfer latency of a turn
    others_per_instance: F64  # m = (N - 1) / D
    others_per_bound_s: F64  # m / T_bound
    throughput_s: F64  # T_bound
    max_batch: F64  # mean decode slots per instance

    def solve(self, env_s: F64 | float, o: float, num_iterations: int) -> tuple[F64, F64, F64]:
        """Decode batch B, decode and whole latency of one turn with env steps of ``env_s``."""
        m, m_per_bound, t_bound = (
            self.others_per_instance,
            self.others_per_bound_s,
            self.throughput_s,
        )
        fixed_s = self.own_s + env_s
        batch = np.ones_like(t_bound)
        for _ in range(num_iterations):
            tau, slope = self.step.mean(batch)
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
            batch = np.minimum(np.maximum(b, 1.0), self.max_batch)
        decode_s = o * self.step.mean(batch)[0]
        return batch, decode_s, fixed_s + decode_s

    def subset(self, where: Index, shape: tuple[int, int]) -> _Batching:
        """The entries at flat indices ``where`` of arrays of ``shape``, as 1-D arrays.

        Only with one decode group per configuration (rows are configurations).
        """
        return _Batching(
            step=self.step.subset(where, shape),
            own_s=_flat_take(self.own_s, where, shape),
            others_per_instance=_flat_take(self.others_per_instance, where, shape),
            others_per_bound_s=_flat_take(self.others_per_bound_s, where, shape),
            throughput_s=_flat_take(self.throughput_s, where, shape),
            max_batch=_flat_take(self.max_batch, where, shape),
        )


def _flat_take(x: F64, where: Index, shape: tuple[int, int]) -> F64:
    """Entries at flat indices ``where`` of ``x`` broadcast to ``shape`` (C, S)."""
    if x.shape == shape:
        return np.take(x, where)
    if x.shape == (shape[0], 1):
        return np.take(x, where // shape[1])
    return np.take(np.broadcast_to(x, shape), where)


@dataclass(frozen=True)
class _DecodeStep:
    """Decode step time of each decode row, and its capacity-weighted mean per config.

    Per row, tau = base + B per_seq in the small and in the large batch regime.
    """

    g: EngineGroups
    b_max: F64  # decode slots per instance
    n_dec: F64  # instances whose KV cache holds one context
    num_dec: F64  # their sum per configuration
    large_from: F64  # batch from which the large regime applies
    per_seq_small: F64
    per_seq_large: F64
    base_small: F64
    base_large: F64
    one_row: bool  # every configuration has one decode row: rows are configurations
    single: NDArray[np.bool_]  # (C, 1) configurations of one decode row

    @staticmethod
    def of(
        g: EngineGroups, kv_tokens: F64, inter: F64, b_max: F64, n_dec: F64, num_dec: F64
    ) -> _DecodeStep:
        per_seq_small = g.dec_small[1] + g.dec_small[2] * kv_tokens + inter
        base_small = g.dec_small[0] - inter
        sizes = np.diff(np.append(g.dec_start, len(g.dec_owner)))
        return _DecodeStep(
            g=g,
            b_max=b_max,
            n_dec=n_dec,
            num_dec=num_dec,
            large_from=g.dec_large_batch_from,
            per_seq_small=per_seq_small,
            per_seq_large=per_seq_small
            + (g.dec_large[1] + g.dec_large[2] * kv_tokens + inter - per_seq_small),
            base_small=base_small,
            base_large=base_small + (g.dec_large[0] - g.dec_small[0]),
            one_row=len(g.dec_owner) == g.num_configs,
            single=(sizes == 1)[:, None],
        )

    def rows(self, batch: F64) -> tuple[F64, F64]:
        """Per-row step time at per-instance batch ``batch`` and its slope in batch."""
        b = np.minimum(batch, self.b_max)
        large = b >= self.large_from
        per_seq = np.where(large, self.per_seq_large, self.per_seq_small)
        base = np.where(large, self.base_large, self.base_small)
        return np.maximum(base + b * per_seq, _TINY), per_seq * (batch < self.b_max)

    def mean(self, batch: F64) -> tuple[F64, F64]:
        """Capacity-weighted (harmonic) mean step time of each configuration, and its slope."""
        g = self.g
        tau, slope = self.rows(g.dec_spread(batch))
        if self.one_row:
            return tau, slope
        weight = self.n_dec / tau
        tau_mean = self.num_dec / np.maximum(g.dec_sum(weight), _TINY)
        slope_mean = tau_mean**2 / self.num_dec * g.dec_sum(weight * slope / tau)
        # A configuration of one group keeps its own step time (no rounding of the mean).
        tau_mean = np.where(self.single, np.take(tau, g.dec_start, axis=0), tau_mean)
        slope_mean = np.where(self.single, np.take(slope, g.dec_start, axis=0), slope_mean)
        return tau_mean, slope_mean

    def subset(self, where: Index, shape: tuple[int, int]) -> _DecodeStep:
        """The rows' entries at flat indices ``where`` (one row per configuration)."""
        return replace(
            self,
            b_max=_flat_take(self.b_max, where, shape),
            large_from=_flat_take(self.large_from, where, shape),
            per_seq_small=_flat_take(self.per_seq_small, where, shape),
            per_seq_large=_flat_take(self.per_seq_large, where, shape),
            base_small=_flat_take(self.base_small, where, shape),
            base_large=_flat_take(self.base_large, where, shape),
        )
