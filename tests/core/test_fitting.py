"""Fitting profile coefficients: recovery, the relative-error objective, threshold search, errors.

Records are synthetic, generated from known coefficients with a seeded numpy Generator; the
noise is multiplicative (log-normal), the shape of timing noise.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import nnls

from pearl.core.fitting import (
    MIN_RECORDS_PER_REGIME,
    DecodeRecord,
    FitReport,
    PrefillRecord,
    fit_decode,
    fit_decode_with_report,
    fit_engine_profile,
    fit_engine_profile_with_report,
    fit_prefill,
    fit_prefill_with_report,
)
from pearl.core.profile import DecodeCoeffs, DecodeRegime, EngineProfile, PrefillCoeffs

TRUE_PREFILL = PrefillCoeffs(a_s=5e-3, b_s_per_token=4e-5, c_s_per_token2=8.5e-10)
TRUE_DECODE = DecodeCoeffs(
    small=DecodeRegime(base_s=7.2e-3, per_seq_s=2e-6, per_ctx_token_s=5.5e-8),
    large=DecodeRegime(base_s=1.6e-3, per_seq_s=4.4e-5, per_ctx_token_s=5.5e-8),
    large_batch_from=128,
)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 256)


def prefill_records(
    rng: np.random.Generator, coeffs: PrefillCoeffs, num: int, noise: float = 0.0
) -> list[PrefillRecord]:
    """Batches of 1-8 sequences, 16-4096 new tokens each, half of them on a cached prefix."""
    out = []
    for _ in range(num):
        k = int(rng.integers(1, 9))
        new = tuple(int(x) for x in rng.integers(16, 4097, k))
        prefix = tuple(int(x) if rng.random() < 0.5 else 0 for x in rng.integers(0, 16385, k))
        t = coeffs.batch_s(new, prefix) * (rng.lognormal(0.0, noise) if noise else 1.0)
        out.append(PrefillRecord(new_tokens=new, prefix_tokens=prefix, duration_s=float(t)))
    return out


def decode_records(
    rng: np.random.Generator,
    coeffs: DecodeCoeffs,
    per_size: int = 6,
    noise: float = 0.0,
    sizes: tuple[int, ...] = BATCH_SIZES,
) -> list[DecodeRecord]:
    """``per_size`` steps per batch size, each sequence holding 128-8192 context tokens."""
    out = []
    for b in sizes:
        for _ in range(per_size):
            ctx = int(rng.integers(128, 8193, b).sum())
            t = float(coeffs.step_s(b, ctx)) * (rng.lognormal(0.0, noise) if noise else 1.0)
            out.append(DecodeRecord(batch_size=b, ctx_tokens=ctx, duration_s=t))
    return out


def assert_regime_close(got: DecodeRegime, want: DecodeRegime, rel: float, abs_: float) -> None:
    for field in ("base_s", "per_seq_s", "per_ctx_token_s"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=rel, abs=abs_), field


# --- prefill -------------------------------------------------------------------------


def test_prefill_noiseless_recovers_coefficients() -> None:
    rng = np.random.default_rng(0)
    got = fit_prefill(prefill_records(rng, TRUE_PREFILL, 40))
    assert got.a_s == pytest.approx(TRUE_PREFILL.a_s, rel=1e-8)
    assert got.b_s_per_token == pytest.approx(TRUE_PREFILL.b_s_per_token, rel=1e-8)
    assert got.c_s_per_token2 == pytest.approx(TRUE_PREFILL.c_s_per_token2, rel=1e-8)


def test_prefill_noisy_recovers_coefficients_loosely() -> None:
    rng = np.random.default_rng(1)
    records = prefill_records(rng, TRUE_PREFILL, 400, noise=0.03)
    got, report = fit_prefill_with_report(records)
    assert got.a_s == pytest.approx(TRUE_PREFILL.a_s, rel=0.25)
    assert got.b_s_per_token == pytest.approx(TRUE_PREFILL.b_s_per_token, rel=0.05)
    assert got.c_s_per_token2 == pytest.approx(TRUE_PREFILL.c_s_per_token2, rel=0.1)
    assert report.prefill is not None
    assert report.prefill.n == 400
    assert report.prefill.rel_rms_error == pytest.approx(0.03, rel=0.2)


def test_prefill_fit_matches_batch_s() -> None:
    """The fitted model is the one ``PrefillCoeffs.batch_s`` evaluates (prefix included)."""
    rng = np.random.default_rng(2)
    records = prefill_records(rng, TRUE_PREFILL, 30)
    got = fit_prefill(records)
    for r in records:
        assert got.batch_s(r.new_tokens, r.prefix_tokens) == pytest.approx(r.duration_s, rel=1e-8)


def _absolute_nnls(records: list[PrefillRecord]) -> PrefillCoeffs:
    """What plain (absolute-error) non-negative least squares would fit."""
    design = np.array(
        [
            (
                1.0,
                sum(r.new_tokens),
                sum(
                    (p + n) ** 2 - p**2 for n, p in zip(r.new_tokens, r.prefix_tokens, strict=True)
                ),
            )
            for r in records
        ],
        dtype=float,
    )
    durations = np.array([r.duration_s for r in records])
    norms = np.linalg.norm(design, axis=0)
    x, _ = nnls(design / norms, durations)
    a, b, c = (float(v) for v in x / norms)
    return PrefillCoeffs(a_s=a, b_s_per_token=b, c_s_per_token2=c)


def test_relative_objective_keeps_short_batches_right() -> None:
    """10 % timing noise on 10 short and 50 long batches: the long ones' absolute errors
    (tens of ms) dwarf a 5 ms batch, so absolute least squares mispredicts short batches;
    the relative objective does not."""
    worst_rel, worst_abs = [], []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        sizes = np.concatenate([rng.integers(1, 33, 10), rng.integers(4096, 16385, 50)])
        records = [
            PrefillRecord(
                (int(n),), (0,), TRUE_PREFILL.batch_s([n]) * float(rng.lognormal(0.0, 0.1))
            )
            for n in sizes
        ]
        relative, absolute = fit_prefill(records), _absolute_nnls(records)
        short = range(1, 33)
        truth = [TRUE_PREFILL.batch_s([n]) for n in short]
        worst_rel.append(
            max(abs(relative.batch_s([n]) / t - 1) for n, t in zip(short, truth, strict=True))
        )
        worst_abs.append(
            max(abs(absolute.batch_s([n]) / t - 1) for n, t in zip(short, truth, strict=True))
        )
    assert max(worst_rel) < 0.12
    assert np.mean(worst_rel) < 0.05
    assert np.mean(worst_abs) > 0.25
    assert np.mean(worst_abs) > 5 * np.mean(worst_rel)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 8192), st.integers(0, 8192), st.floats(1e-4, 10.0)),
        min_size=3,
        max_size=30,
    )
)
def test_prefill_coefficients_non_negative(rows: list[tuple[int, int, float]]) -> None:
    """Whatever the durations, coefficients come out non-negative and finite."""
    records = [PrefillRecord((n,), (p,), t) for n, p, t in rows]
    try:
        got = fit_prefill(records)
    except ValueError as e:  # records that do not determine the coefficients
        assert "do not determine" in str(e)
        return
    for v in (got.a_s, got.b_s_per_token, got.c_s_per_token2):
        assert v >= 0 and math.isfinite(v)


# --- decode --------------------------------------------------------------------------


def test_decode_noiseless_given_threshold() -> None:
    rng = np.random.default_rng(3)
    got = fit_decode(decode_records(rng, TRUE_DECODE), large_batch_from=128)
    assert got.large_batch_from == 128
    assert_regime_close(got.small, TRUE_DECODE.small, rel=1e-7, abs_=1e-15)
    assert_regime_close(got.large, TRUE_DECODE.large, rel=1e-7, abs_=1e-15)


def test_decode_threshold_search_finds_boundary_noiseless() -> None:
    rng = np.random.default_rng(4)
    got, report = fit_decode_with_report(decode_records(rng, TRUE_DECODE))
    assert got.large_batch_from == TRUE_DECODE.large_batch_from
    assert_regime_close(got.small, TRUE_DECODE.small, rel=1e-7, abs_=1e-15)
    assert_regime_close(got.large, TRUE_DECODE.large, rel=1e-7, abs_=1e-15)
    assert report.decode_small is not None and report.decode_large is not None
    assert report.decode_small.n + report.decode_large.n == 6 * len(BATCH_SIZES)
    assert report.decode_small.rel_rms_error < 1e-10
    assert any("large_batch_from=128" in note for note in report.notes)


def _two_regimes(boundary: int, jump: float) -> DecodeCoeffs:
    """Flat (memory-bound) below ``boundary``, rising from it on; at the boundary the large
    regime is ``jump`` times the small one (1.0: continuous, a plain roofline kink)."""
    small = DecodeRegime(base_s=7.2e-3, per_seq_s=0.0, per_ctx_token_s=5.5e-8)
    per_seq = (jump * 7.2e-3 - 1.6e-3) / boundary
    large = DecodeRegime(base_s=1.6e-3, per_seq_s=per_seq, per_ctx_token_s=5.5e-8)
    return DecodeCoeffs(small=small, large=large, large_batch_from=boundary)


@pytest.mark.parametrize("boundary", [16, 64, 128, 192], ids=lambda b: f"boundary{b}")
def test_decode_threshold_search_with_noise(boundary: int) -> None:
    """2 % noise, a step up by half at the boundary: the search finds it exactly."""
    truth = _two_regimes(boundary, jump=1.5)
    rng = np.random.default_rng(5)
    got = fit_decode(decode_records(rng, truth, per_size=10, noise=0.02))
    assert got.large_batch_from == boundary
    assert got.small.base_s == pytest.approx(truth.small.base_s, rel=0.05)
    batch = np.array(BATCH_SIZES, dtype=float)
    ctx = batch * 4160  # the mean context per sequence of decode_records
    np.testing.assert_allclose(got.step_s(batch, ctx), truth.step_s(batch, ctx), rtol=0.03)


@pytest.mark.parametrize("boundary", [16, 64, 128, 192], ids=lambda b: f"boundary{b}")
def test_decode_threshold_search_at_a_continuous_kink(boundary: int) -> None:
    """Where the regimes meet continuously, the boundary batch size lies on both lines and
    near it the kink is as small as the noise (here the context term dominates the step), so
    the threshold may land a few observed sizes off; the predicted step times stay right."""
    truth = _two_regimes(boundary, jump=1.0)
    rng = np.random.default_rng(6)
    got = fit_decode(decode_records(rng, truth, per_size=10, noise=0.02))
    assert got.large_batch_from in BATCH_SIZES
    batch = np.array(BATCH_SIZES, dtype=float)
    ctx = batch * 4160
    np.testing.assert_allclose(got.step_s(batch, ctx), truth.step_s(batch, ctx), rtol=0.03)


def test_decode_threshold_is_an_observed_batch_size() -> None:
    rng = np.random.default_rng(6)
    records = decode_records(rng, TRUE_DECODE, noise=0.05)
    got = fit_decode(records)
    assert got.large_batch_from in {r.batch_size for r in records}


def test_decode_without_a_valid_split_fits_one_regime() -> None:
    """Too few records for two regimes: one regime for both, threshold past the data."""
    rng = np.random.default_rng(7)
    records = decode_records(rng, TRUE_DECODE, per_size=2, sizes=(1, 2, 4, 8))
    got, report = fit_decode_with_report(records)
    assert got.large_batch_from == 9
    assert got.small == got.large
    assert_regime_close(got.small, TRUE_DECODE.small, rel=1e-7, abs_=1e-15)
    assert report.decode_large is None
    assert "one regime" in report.notes[0]


def test_decode_each_side_needs_enough_records() -> None:
    """A split that would leave fewer than MIN_RECORDS_PER_REGIME records on a side is not
    considered, even where it would fit that side perfectly."""
    rng = np.random.default_rng(8)
    records = decode_records(rng, TRUE_DECODE, per_size=1, sizes=(1, 2, 4, 8, 16, 32, 64))
    records += decode_records(rng, TRUE_DECODE, per_size=2, sizes=(128, 256))
    got = fit_decode(records)
    large_side = [r for r in records if r.batch_size >= got.large_batch_from]
    assert len(large_side) >= MIN_RECORDS_PER_REGIME or got.small == got.large


# --- engine and report ---------------------------------------------------------------


def test_fit_engine_profile_round_trip() -> None:
    rng = np.random.default_rng(9)
    engine, report = fit_engine_profile_with_report(
        prefill_records(rng, TRUE_PREFILL, 30),
        decode_records(rng, TRUE_DECODE),
        tp=2,
        max_num_seqs=128,
    )
    assert isinstance(engine, EngineProfile)
    assert engine.tp == 2
    assert engine.max_num_seqs == 128
    assert engine.max_batched_tokens == EngineProfile.model_fields["max_batched_tokens"].default
    assert engine.kv_capacity_tokens is None
    assert engine.decode.large_batch_from == 128
    assert engine.prefill.b_s_per_token == pytest.approx(TRUE_PREFILL.b_s_per_token, rel=1e-8)
    assert report.prefill is not None and report.decode_small is not None
    assert report.decode_large is not None
    json.dumps(report.as_dict())  # loggable as one JSON line


def test_fit_engine_profile_rejects_non_power_of_two_tp() -> None:
    rng = np.random.default_rng(10)
    with pytest.raises(ValueError, match="power of two"):
        fit_engine_profile(
            prefill_records(rng, TRUE_PREFILL, 10), decode_records(rng, TRUE_DECODE), tp=3
        )


def test_report_merge_keeps_both_sides() -> None:
    rng = np.random.default_rng(11)
    _, p = fit_prefill_with_report(prefill_records(rng, TRUE_PREFILL, 10))
    _, d = fit_decode_with_report(decode_records(rng, TRUE_DECODE))
    merged = p.merged(d)
    assert merged.prefill == p.prefill
    assert merged.decode_small == d.decode_small
    assert FitReport().as_dict()["prefill"] is None


# --- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"new_tokens": (10, 20), "prefix_tokens": (0,), "duration_s": 1.0},
            "prefix_tokens has 1 entries but new_tokens has 2",
            id="mismatched-lengths",
        ),
        pytest.param(
            {"new_tokens": (), "prefix_tokens": (), "duration_s": 1.0},
            "new_tokens is empty",
            id="empty-batch",
        ),
        pytest.param(
            {"new_tokens": (10,), "prefix_tokens": (0,), "duration_s": 0.0},
            "duration_s must be positive",
            id="zero-duration",
        ),
        pytest.param(
            {"new_tokens": (10,), "prefix_tokens": (0,), "duration_s": -1.0},
            "duration_s must be positive",
            id="negative-duration",
        ),
        pytest.param(
            {"new_tokens": (10,), "prefix_tokens": (0,), "duration_s": float("nan")},
            "finite",
            id="nan-duration",
        ),
        pytest.param(
            {"new_tokens": (0,), "prefix_tokens": (0,), "duration_s": 1.0},
            "new_tokens must be >= 1",
            id="zero-new-tokens",
        ),
        pytest.param(
            {"new_tokens": (10,), "prefix_tokens": (-1,), "duration_s": 1.0},
            "prefix_tokens must be >= 0",
            id="negative-prefix",
        ),
    ],
)
def test_bad_prefill_record(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrefillRecord(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"batch_size": 0, "ctx_tokens": 10, "duration_s": 1.0}, "batch_size", id="b0"),
        pytest.param({"batch_size": 1, "ctx_tokens": -1, "duration_s": 1.0}, "ctx_tokens", id="k"),
        pytest.param({"batch_size": 1, "ctx_tokens": 1, "duration_s": 0.0}, "duration_s", id="t0"),
        pytest.param(
            {"batch_size": 1, "ctx_tokens": 1, "duration_s": float("inf")}, "finite", id="inf"
        ),
    ],
)
def test_bad_decode_record(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecodeRecord(**kwargs)  # type: ignore[arg-type]


def test_too_few_prefill_records() -> None:
    records = [PrefillRecord((10,), (0,), 0.01), PrefillRecord((20,), (0,), 0.02)]
    with pytest.raises(ValueError, match="fit_prefill: 2 records, need at least 3"):
        fit_prefill(records)


def test_too_few_decode_records() -> None:
    with pytest.raises(ValueError, match="fit_decode: 1 records, need at least 3"):
        fit_decode([DecodeRecord(1, 100, 0.007)])


def test_prefill_records_that_do_not_determine_the_coefficients() -> None:
    records = [PrefillRecord((100,), (0,), 0.01 * (1 + i / 100)) for i in range(5)]
    with pytest.raises(ValueError, match="do not determine a, b and c"):
        fit_prefill(records)


def test_decode_side_without_records() -> None:
    rng = np.random.default_rng(12)
    records = decode_records(rng, TRUE_DECODE, sizes=(1, 2, 4, 8))
    with pytest.raises(ValueError, match="0 records in the large regime"):
        fit_decode(records, large_batch_from=64)


def test_decode_side_with_one_batch_size() -> None:
    rng = np.random.default_rng(13)
    records = decode_records(rng, TRUE_DECODE, sizes=(1, 2, 4, 8, 16))
    with pytest.raises(ValueError, match="large-regime records do not determine"):
        fit_decode(records, large_batch_from=16)


def test_decode_threshold_must_be_positive() -> None:
    rng = np.random.default_rng(14)
    with pytest.raises(ValueError, match="large_batch_from must be >= 1"):
        fit_decode(decode_records(rng, TRUE_DECODE), large_batch_from=0)
