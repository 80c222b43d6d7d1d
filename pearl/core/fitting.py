"""Fit runtime-profile coefficients to measured prefill batches and decode steps.

Models (those of ``pearl.core.profile``):

- prefill of one batch whose i-th sequence adds ``n_i`` new tokens to a cached prefix of
  ``p_i`` tokens: ``a + b * sum(n_i) + c * sum((p_i + n_i)**2 - p_i**2)``
  (``PrefillCoeffs.batch_s``);
- one decode step of ``B`` sequences holding ``K`` context tokens in total:
  ``base + per_seq * B + per_ctx * K``, with one coefficient set for ``B`` below
  ``large_batch_from`` and another from it on (``DecodeCoeffs.step_s``).

Objective: each model is linear in its coefficients, and they are found by non-negative
least squares on the *relative* error, ``sum(((predicted - measured) / measured)**2)``:
every design row is divided by its measured duration and the target is a vector of ones.
A 5 ms step counts as much as a 5 s batch, which is what a predictor of both short decode
steps and long prefills needs; absolute least squares would let the long batches swamp
the short ones. Columns are scaled to unit norm before the solve (the scaling does not
change the solution, only the conditioning).

Decode threshold: with ``large_batch_from`` given, each side of it is fitted on its own.
Without it, every observed batch size ``t`` that leaves each side ``B < t`` and ``B >= t``
with at least ``MIN_RECORDS_PER_REGIME`` records and two distinct batch sizes (so all
three coefficients are determined) is a candidate, and the one with the lowest total
squared relative error wins (ties: the smallest ``t``). When no candidate exists, one
regime is fitted to all records, used for both sides, and ``large_batch_from`` is the
largest observed batch size plus one; the report says so.

Invariants (asserted by ``tests/core/test_fitting.py``):
- every fitted coefficient is non-negative and finite;
- noiseless records generated from non-negative coefficients with a full-rank design are
  reproduced exactly (to solver precision), and a chosen threshold is an observed batch
  size;
- the functions are pure and deterministic: no I/O, no clock, no randomness;
- bad input raises ``ValueError`` naming the problem: too few records, records that do not
  determine the coefficients, non-positive or non-finite durations, mismatched
  ``new_tokens``/``prefix_tokens`` lengths, out-of-range token counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import nnls

from pearl.core.profile import DecodeCoeffs, DecodeRegime, EngineProfile, PrefillCoeffs

MIN_PREFILL_RECORDS = 3
"""Fewest prefill records: one per coefficient."""

MIN_RECORDS_PER_REGIME = 6
"""Fewest decode records on each side of a searched threshold (twice the coefficients)."""

_MIN_DECODE_RECORDS = 3  # fewest records for one decode regime fitted on its own

Matrix = NDArray[np.float64]
Vector = NDArray[np.float64]


def _check_duration(what: str, duration_s: float) -> None:
    if not math.isfinite(duration_s) or duration_s <= 0:
        raise ValueError(f"{what}: duration_s must be positive and finite, got {duration_s!r}")


@dataclass(frozen=True)
class PrefillRecord:
    """One measured prefill batch: new and cached-prefix tokens per sequence, and its time."""

    new_tokens: tuple[int, ...]
    prefix_tokens: tuple[int, ...]
    duration_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "new_tokens", tuple(self.new_tokens))
        object.__setattr__(self, "prefix_tokens", tuple(self.prefix_tokens))
        if not self.new_tokens:
            raise ValueError("PrefillRecord: new_tokens is empty (a batch has a sequence)")
        if len(self.prefix_tokens) != len(self.new_tokens):
            raise ValueError(
                f"PrefillRecord: prefix_tokens has {len(self.prefix_tokens)} entries but "
                f"new_tokens has {len(self.new_tokens)} (one each per sequence; 0 for no prefix)"
            )
        if min(self.new_tokens) < 1:
            raise ValueError(f"PrefillRecord: new_tokens must be >= 1, got {self.new_tokens}")
        if min(self.prefix_tokens) < 0:
            raise ValueError(f"PrefillRecord: prefix_tokens must be >= 0, got {self.prefix_tokens}")
        _check_duration("PrefillRecord", self.duration_s)


@dataclass(frozen=True)
class DecodeRecord:
    """One measured decode step: sequences in the batch, their total context, its time."""

    batch_size: int
    ctx_tokens: int
    duration_s: float

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"DecodeRecord: batch_size must be >= 1, got {self.batch_size}")
        if self.ctx_tokens < 0:
            raise ValueError(f"DecodeRecord: ctx_tokens must be >= 0, got {self.ctx_tokens}")
        _check_duration("DecodeRecord", self.duration_s)


@dataclass(frozen=True)
class FitQuality:
    """How well one fitted part reproduces its records (relative errors)."""

    n: int
    rel_rms_error: float
    max_abs_rel_error: float


@dataclass(frozen=True)
class FitReport:
    """Fit quality per part, for the caller to log; a part not fitted is None."""

    prefill: FitQuality | None = None
    decode_small: FitQuality | None = None
    decode_large: FitQuality | None = None
    notes: tuple[str, ...] = ()

    def merged(self, other: FitReport) -> FitReport:
        """This report with the parts ``other`` has filled in (``other`` wins)."""
        return FitReport(
            prefill=other.prefill or self.prefill,
            decode_small=other.decode_small or self.decode_small,
            decode_large=other.decode_large or self.decode_large,
            notes=self.notes + other.notes,
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain data for a JSON log line."""
        parts = {"prefill": self.prefill, "decode_small": self.decode_small}
        parts["decode_large"] = self.decode_large
        out: dict[str, Any] = {
            name: None if q is None else vars(q).copy() for name, q in parts.items()
        }
        out["notes"] = list(self.notes)
        return out


@dataclass(frozen=True)
class _Solution:
    coeffs: Vector
    rel_residuals: Vector

    @property
    def sse(self) -> float:
        return float(self.rel_residuals @ self.rel_residuals)

    def quality(self) -> FitQuality:
        r = self.rel_residuals
        return FitQuality(
            n=len(r),
            rel_rms_error=float(np.sqrt(np.mean(r**2))),
            max_abs_rel_error=float(np.max(np.abs(r))),
        )


def _full_rank(design: Matrix, durations: Vector) -> bool:
    scaled = design / durations[:, None]
    norms = np.linalg.norm(scaled, axis=0)
    if np.any(norms == 0):
        return False
    return bool(np.linalg.matrix_rank(scaled / norms) == design.shape[1])


def _solve_relative(design: Matrix, durations: Vector) -> _Solution:
    """Non-negative least squares on relative error; the design must have full column rank."""
    scaled = design / durations[:, None]
    norms = np.linalg.norm(scaled, axis=0)
    x, _ = nnls(scaled / norms, np.ones(len(durations)))
    coeffs = np.maximum(np.asarray(x, dtype=float) / norms, 0.0)
    rel = (design @ coeffs - durations) / durations
    return _Solution(coeffs=coeffs, rel_residuals=rel)


# --- prefill -------------------------------------------------------------------------


def _prefill_design(records: Sequence[PrefillRecord]) -> tuple[Matrix, Vector]:
    design = np.empty((len(records), 3))
    durations = np.empty(len(records))
    for i, rec in enumerate(records):
        n = np.asarray(rec.new_tokens, dtype=float)
        p = np.asarray(rec.prefix_tokens, dtype=float)
        design[i] = (1.0, n.sum(), ((p + n) ** 2 - p**2).sum())
        durations[i] = rec.duration_s
    return design, durations


def fit_prefill_with_report(
    records: Sequence[PrefillRecord],
) -> tuple[PrefillCoeffs, FitReport]:
    """Prefill coefficients and the fit's quality (see the module docstring)."""
    if len(records) < MIN_PREFILL_RECORDS:
        raise ValueError(
            f"fit_prefill: {len(records)} records, need at least {MIN_PREFILL_RECORDS}"
        )
    design, durations = _prefill_design(records)
    if not _full_rank(design, durations):
        raise ValueError(
            "fit_prefill: the records do not determine a, b and c; they need batches of "
            "different total new tokens and different token-pair counts (vary the lengths)"
        )
    sol = _solve_relative(design, durations)
    a, b, c = (float(v) for v in sol.coeffs)
    coeffs = PrefillCoeffs(a_s=a, b_s_per_token=b, c_s_per_token2=c)
    return coeffs, FitReport(prefill=sol.quality())


def fit_prefill(records: Sequence[PrefillRecord]) -> PrefillCoeffs:
    """Prefill coefficients by non-negative least squares on relative error."""
    return fit_prefill_with_report(records)[0]


# --- decode --------------------------------------------------------------------------


def _decode_design(records: Sequence[DecodeRecord]) -> tuple[Matrix, Vector, Vector]:
    batch = np.array([r.batch_size for r in records], dtype=float)
    ctx = np.array([r.ctx_tokens for r in records], dtype=float)
    durations = np.array([r.duration_s for r in records], dtype=float)
    design = np.column_stack([np.ones(len(records)), batch, ctx])
    return design, durations, batch


def _regime(sol: _Solution) -> DecodeRegime:
    base, per_seq, per_ctx = (float(v) for v in sol.coeffs)
    return DecodeRegime(base_s=base, per_seq_s=per_seq, per_ctx_token_s=per_ctx)


def _fit_side(
    design: Matrix, durations: Vector, batch: Vector, mask: NDArray[np.bool_], side: str
) -> _Solution:
    n = int(mask.sum())
    if n < _MIN_DECODE_RECORDS:
        raise ValueError(
            f"fit_decode: {n} records in the {side} regime, need at least {_MIN_DECODE_RECORDS}"
        )
    if not _full_rank(design[mask], durations[mask]):
        raise ValueError(
            f"fit_decode: the {side}-regime records do not determine base, per-sequence and "
            f"per-context-token costs (batch sizes seen: {sorted(set(batch[mask].astype(int)))}); "
            "they need at least two batch sizes and context totals that vary independently"
        )
    return _solve_relative(design[mask], durations[mask])


def _candidate_ok(
    design: Matrix, durations: Vector, batch: Vector, mask: NDArray[np.bool_]
) -> bool:
    return (
        int(mask.sum()) >= MIN_RECORDS_PER_REGIME
        and len(np.unique(batch[mask])) >= 2
        and _full_rank(design[mask], durations[mask])
    )


def _search_threshold(
    design: Matrix, durations: Vector, batch: Vector
) -> tuple[int, _Solution, _Solution] | None:
    best: tuple[float, int, _Solution, _Solution] | None = None
    for t in np.unique(batch)[1:]:
        small, large = batch < t, batch >= t
        if not (
            _candidate_ok(design, durations, batch, small)
            and _candidate_ok(design, durations, batch, large)
        ):
            continue
        s = _solve_relative(design[small], durations[small])
        g = _solve_relative(design[large], durations[large])
        total = s.sse + g.sse
        if best is None or total < best[0]:
            best = (total, int(t), s, g)
    return None if best is None else best[1:]


def fit_decode_with_report(
    records: Sequence[DecodeRecord], large_batch_from: int | None = None
) -> tuple[DecodeCoeffs, FitReport]:
    """Two-regime decode coefficients and the fit's quality (see the module docstring)."""
    if len(records) < _MIN_DECODE_RECORDS:
        raise ValueError(f"fit_decode: {len(records)} records, need at least {_MIN_DECODE_RECORDS}")
    design, durations, batch = _decode_design(records)
    if large_batch_from is not None:
        if large_batch_from < 1:
            raise ValueError(f"fit_decode: large_batch_from must be >= 1, got {large_batch_from}")
        s = _fit_side(design, durations, batch, batch < large_batch_from, "small")
        g = _fit_side(design, durations, batch, batch >= large_batch_from, "large")
        report = FitReport(decode_small=s.quality(), decode_large=g.quality())
        coeffs = DecodeCoeffs(small=_regime(s), large=_regime(g), large_batch_from=large_batch_from)
        return coeffs, report
    found = _search_threshold(design, durations, batch)
    if found is not None:
        t, s, g = found
        report = FitReport(
            decode_small=s.quality(),
            decode_large=g.quality(),
            notes=(f"large_batch_from={t} chosen by lowest total squared relative error",),
        )
        return DecodeCoeffs(small=_regime(s), large=_regime(g), large_batch_from=t), report
    one = _fit_side(design, durations, batch, np.ones(len(records), dtype=bool), "single")
    beyond = int(batch.max()) + 1
    note = (
        f"no threshold leaves {MIN_RECORDS_PER_REGIME} records and two batch sizes on each "
        f"side: one regime fitted to all records, large_batch_from={beyond}"
    )
    regime = _regime(one)
    coeffs = DecodeCoeffs(small=regime, large=regime, large_batch_from=beyond)
    return coeffs, FitReport(decode_small=one.quality(), notes=(note,))


def fit_decode(
    records: Sequence[DecodeRecord], large_batch_from: int | None = None
) -> DecodeCoeffs:
    """Two-regime decode coefficients by non-negative least squares on relative error."""
    return fit_decode_with_report(records, large_batch_from)[0]


# --- engine --------------------------------------------------------------------------


def fit_engine_profile_with_report(
    prefill_records: Sequence[PrefillRecord],
    decode_records: Sequence[DecodeRecord],
    tp: int,
    *,
    large_batch_from: int | None = None,
    max_num_seqs: int | None = None,
    max_batched_tokens: int | None = None,
    kv_capacity_tokens: int | None = None,
) -> tuple[EngineProfile, FitReport]:
    """An engine profile for one TP degree from its measurements, and the fit's quality.

    Limits left as None take ``EngineProfile``'s defaults (``kv_capacity_tokens``: derived
    from memory by ``RuntimeProfile.kv_capacity_tokens``).
    """
    prefill, prefill_report = fit_prefill_with_report(prefill_records)
    decode, decode_report = fit_decode_with_report(decode_records, large_batch_from)
    limits = {
        "max_num_seqs": max_num_seqs,
        "max_batched_tokens": max_batched_tokens,
        "kv_capacity_tokens": kv_capacity_tokens,
    }
    given = {k: v for k, v in limits.items() if v is not None}
    engine = EngineProfile(tp=tp, prefill=prefill, decode=decode, **given)
    return engine, prefill_report.merged(decode_report)


def fit_engine_profile(
    prefill_records: Sequence[PrefillRecord],
    decode_records: Sequence[DecodeRecord],
    tp: int,
    *,
    large_batch_from: int | None = None,
    max_num_seqs: int | None = None,
    max_batched_tokens: int | None = None,
    kv_capacity_tokens: int | None = None,
) -> EngineProfile:
    """An engine profile for one TP degree from its measurements (see the report variant)."""
    return fit_engine_profile_with_report(
        prefill_records,
        decode_records,
        tp,
        large_batch_from=large_batch_from,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        kv_capacity_tokens=kv_capacity_tokens,
    )[0]
