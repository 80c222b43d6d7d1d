"""Engine groups: a batch of PD configurations as coefficient rows for the turn model.

``engine_groups`` flattens the instance groups of C configurations into the rows of a
prefill pool and a decode pool (``EngineGroups``, shape (rows, 1)), one row per (role,
GPU type, TP) group with its count and the profile's coefficients. A colocated group is
a row of both pools. ``TurnShape`` holds the per-turn means of the workload.

Invariants: rows of one configuration are contiguous and in the configuration's order;
a configuration with a group the profile cannot serve (no engine, no KV room) is left out
and reported by the returned indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from pearl.core.pd import InstanceSpec, PDConfig
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import Role

F64 = NDArray[np.float64]
Index = NDArray[np.intp]
# Columns of one group's row: instances, KV tokens and link bytes/s per instance, prefill
# a, b, c, max_batched_tokens, decode large_batch_from, small (base, per_seq, per_ctx),
# large (base, per_seq, per_ctx), max_num_seqs.
_COUNT, _KV, _LINK, _A, _B, _C, _MBT, _LBF = range(8)
_SMALL, _LARGE, _MAX_SEQS = (8, 9, 10), (11, 12, 13), 14


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


def _pool(start: Index, num_rows: int) -> tuple[Index, Index]:
    """Per-row owner and per-configuration first row, from the first rows."""
    counts = np.diff(np.append(start, num_rows))
    return np.repeat(np.arange(len(start)), counts), start


@dataclass(frozen=True, eq=False)
class EngineGroups:
    """The instance groups of C configurations as rows of two pools.

    ``pf_*`` rows form the prefill pool (prefill and colocated groups), ``dec_*`` rows the
    decode pool (decode and colocated groups); a colocated group is a row of both. Rows are
    ordered by configuration and every configuration has at least one row in each pool.
    Row columns have shape (rows, 1); per-configuration columns (C, 1).
    """

    num_configs: int
    disaggregated: NDArray[np.bool_]  # (C, 1) some instance is dedicated prefill or decode
    pf_start: Index  # (C,) first prefill row of each configuration
    pf_owner: Index  # (rows,) configuration of each prefill row
    pf_count: F64  # instances
    pf_a_s: F64  # fixed cost of one prefill batch
    pf_b_s: F64  # cost per new token
    pf_c_s: F64  # attention cost per token pair
    pf_max_batched_tokens: F64
    pf_kv_capacity_tokens: F64  # per instance
    dec_start: Index  # (C,) first decode row of each configuration
    dec_owner: Index  # (rows,) configuration of each decode row
    dec_count: F64  # instances
    dec_colocated: F64  # 1 where prefill chunks share the decode steps
    dec_prefill_row: Index  # (rows,) the group's prefill-pool row (any row of its config if none)
    dec_small: tuple[F64, F64, F64]  # (base_s, per_seq_s, per_ctx_token_s), small batches
    dec_large: tuple[F64, F64, F64]  # the same from large_batch_from on
    dec_large_batch_from: F64
    dec_max_num_seqs: F64
    dec_kv_capacity_tokens: F64  # per instance
    num_prefill_instances: F64  # (C, 1)
    num_decode_instances: F64  # (C, 1)
    kv_bytes_per_token: float
    link_instance_bytes_per_s: F64  # (C, 1) one instance's KV link: min of the pools' means
    link_total_bytes_per_s: F64  # (C, 1) all KV links: min of the pools' sums

    def pf_sum(self, x: F64) -> F64:
        """Per-configuration sum of prefill rows: (rows, S) -> (C, S)."""
        return x if len(self.pf_owner) == self.num_configs else _row_sum(x, self.pf_start)

    def pf_spread(self, x: F64) -> F64:
        """A per-configuration array (C, S) on the prefill rows; 1-D arrays are shared."""
        if x.ndim < 2 or len(self.pf_owner) == self.num_configs:
            return x
        return np.take(x, self.pf_owner, axis=0)

    def dec_sum(self, x: F64) -> F64:
        """Per-configuration sum of decode rows: (rows, S) -> (C, S)."""
        return x if len(self.dec_owner) == self.num_configs else _row_sum(x, self.dec_start)

    def dec_spread(self, x: F64) -> F64:
        """A per-configuration array (C, S) on the decode rows; 1-D arrays are shared."""
        if x.ndim < 2 or len(self.dec_owner) == self.num_configs:
            return x
        return np.take(x, self.dec_owner, axis=0)


def _row_sum(x: F64, start: Index) -> F64:
    result: F64 = np.add.reduceat(x, start, axis=0)
    return result


def _unit_row(spec: InstanceSpec, profile: RuntimeProfile) -> list[float] | None:
    """One instance's columns (above), or None without engine profile or KV capacity."""
    e = profile.engine(spec.gpu_type, spec.tp)
    kv_tokens = profile.kv_capacity_tokens(spec.gpu_type, spec.tp)
    if e is None or kv_tokens <= 0:
        return None
    p, sm, lg = e.prefill, e.decode.small, e.decode.large
    link_bytes_per_s = spec.tp * profile.gpus[spec.gpu_type].kv_transfer_gb_per_s * 1e9
    return [
        1.0,
        float(kv_tokens),
        link_bytes_per_s,
        p.a_s,
        p.b_s_per_token,
        p.c_s_per_token2,
        float(e.max_batched_tokens),
        float(e.decode.large_batch_from),
        sm.base_s,
        sm.per_seq_s,
        sm.per_ctx_token_s,
        lg.base_s,
        lg.per_seq_s,
        lg.per_ctx_token_s,
        float(e.max_num_seqs),
    ]


@dataclass
class _Rows:
    """The rows of the configurations kept so far: unit (gpu, tp) and instance count."""

    pf_unit: list[int] = field(default_factory=list)
    pf_count: list[float] = field(default_factory=list)
    dec_unit: list[int] = field(default_factory=list)
    dec_count: list[float] = field(default_factory=list)
    dec_prefill_row: list[int] = field(default_factory=list)  # -1: not colocated
    pf_start: list[int] = field(default_factory=list)
    dec_start: list[int] = field(default_factory=list)
    disaggregated: list[bool] = field(default_factory=list)


def engine_groups(
    configs: Sequence[PDConfig], profile: RuntimeProfile
) -> tuple[EngineGroups | None, list[int]]:
    """The groups of the configurations that can serve, and those configurations' indices.

    A configuration cannot serve any trajectory when it has no prefill-capable or no
    decode-capable instance, or a (gpu type, tp) without engine profile or KV capacity;
    it is left out. Non-inference roles are ignored. None when no configuration is left.
    """
    unit_of: dict[tuple[str, int], int] = {}  # (gpu, tp) -> row of ``units``, -1 if none
    units: list[list[float]] = []
    rows = _Rows()
    kept: list[int] = []
    for index, config in enumerate(configs):
        pf_unit: list[int] = []
        pf_count: list[float] = []
        dec_unit: list[int] = []
        dec_count: list[float] = []
        dec_prefill_row: list[int] = []
        base = len(rows.pf_unit)
        for spec, num in config.instances:
            role = spec.role
            if role is not Role.PREFILL and role is not Role.DECODE and role is not Role.COLOCATED:
                continue
            key = (spec.gpu_type, spec.tp)
            unit = unit_of.get(key)
            if unit is None:
                row = _unit_row(spec, profile)
                unit = unit_of[key] = -1 if row is None else len(units)
                if row is not None:
                    units.append(row)
            if unit < 0:
                break
            if role is not Role.DECODE:
                pf_unit.append(unit)
                pf_count.append(num)
            if role is not Role.PREFILL:
                dec_unit.append(unit)
                dec_count.append(num)
                dec_prefill_row.append(base + len(pf_unit) - 1 if role is Role.COLOCATED else -1)
        else:
            if pf_unit and dec_unit:
                kept.append(index)
                rows.pf_start.append(base)
                rows.dec_start.append(len(rows.dec_unit))
                rows.pf_unit += pf_unit
                rows.pf_count += pf_count
                rows.dec_unit += dec_unit
                rows.dec_count += dec_count
                rows.dec_prefill_row += dec_prefill_row
                colocated = sum(i >= 0 for i in dec_prefill_row)
                rows.disaggregated.append(colocated < len(dec_unit) or colocated < len(pf_unit))
    if not kept:
        return None, kept
    return _stack(rows, np.array(units, dtype=float), profile), kept


def _stack(rows: _Rows, units: F64, profile: RuntimeProfile) -> EngineGroups:
    """Columns of the rows (unit columns, instance counts) and each configuration's pools."""
    num_configs = len(rows.pf_start)
    p = units[rows.pf_unit].T[:, :, None]  # column, row, 1
    d = units[rows.dec_unit].T[:, :, None]
    p[_COUNT, :, 0] = rows.pf_count
    d[_COUNT, :, 0] = rows.dec_count
    pf_owner, pf_start = _pool(np.array(rows.pf_start, dtype=np.intp), p.shape[1])
    dec_owner, dec_start = _pool(np.array(rows.dec_start, dtype=np.intp), d.shape[1])
    prefill_row = np.array(rows.dec_prefill_row, dtype=np.intp)
    colocated = prefill_row >= 0

    def per_config(owner: Index, column: F64) -> F64:
        """Sum of a column over each configuration's rows, sequential in row order."""
        total = np.bincount(owner, weights=column[:, 0], minlength=num_configs)
        return total.astype(np.float64)[:, None]

    pf_instances = per_config(pf_owner, p[_COUNT])
    dec_instances = per_config(dec_owner, d[_COUNT])
    pf_link = per_config(pf_owner, p[_COUNT] * p[_LINK])
    dec_link = per_config(dec_owner, d[_COUNT] * d[_LINK])
    return EngineGroups(
        num_configs=num_configs,
        disaggregated=np.array(rows.disaggregated, dtype=bool)[:, None],
        pf_start=pf_start,
        pf_owner=pf_owner,
        pf_count=p[_COUNT],
        pf_a_s=p[_A],
        pf_b_s=p[_B],
        pf_c_s=p[_C],
        pf_max_batched_tokens=p[_MBT],
        pf_kv_capacity_tokens=p[_KV],
        dec_start=dec_start,
        dec_owner=dec_owner,
        dec_count=d[_COUNT],
        dec_colocated=colocated.astype(float)[:, None],
        dec_prefill_row=np.where(colocated, prefill_row, pf_start[dec_owner]),
        dec_small=(d[_SMALL[0]], d[_SMALL[1]], d[_SMALL[2]]),
        dec_large=(d[_LARGE[0]], d[_LARGE[1]], d[_LARGE[2]]),
        dec_large_batch_from=d[_LBF],
        dec_max_num_seqs=d[_MAX_SEQS],
        dec_kv_capacity_tokens=d[_KV],
        num_prefill_instances=pf_instances,
        num_decode_instances=dec_instances,
        kv_bytes_per_token=float(profile.model.kv_bytes_per_token),
        link_instance_bytes_per_s=np.minimum(pf_link / pf_instances, dec_link / dec_instances),
        link_total_bytes_per_s=np.minimum(pf_link, dec_link),
    )
