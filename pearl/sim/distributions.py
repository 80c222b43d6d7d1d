"""Empirical distributions with a fitted lognormal tail (pure: no I/O, no clock).

Rule (``fit_distribution``): of ``n`` positive observations, each is drawn with probability
``1 / (n + 1)`` (empirical resampling), and with the remaining probability ``1 / (n + 1)``
the draw comes from a lognormal fitted by maximum likelihood to the logarithms of all
observations, conditioned to lie above the largest observation and at most ``max_factor``
(default 4) times it.

Why: resampling reproduces every shape feature of the data that a parametric family would
smooth away (multi-modal lengths, the two regimes of Azure chat and Mooncake long context),
but a finite sample never shows values beyond its own maximum. For exchangeable draws the
chance that the next one exceeds the largest of ``n`` is exactly ``1 / (n + 1)``; that is
the tail's mass, so 31,397 request lengths get a tail of 3e-5 and 27 tool latencies one of
1/28. Fitting the lognormal to all data rather than to the top few points keeps the fit
stable for the small traces (13 SWE-agent steps). The cap keeps one draw from dominating a
batch: untruncated, the tool-latency fit (log-sigma ~2, the slowest of 27 calls 21 s) draws
calls of many minutes and the prompt fit prompts of millions of tokens.

Invariants: every draw is > 0 and at most ``cap * scale``; draws at or below ``threshold *
scale`` (the largest observation) are observations times ``scale``, so the model's quantile
at level ``q < 1 - tail_fraction`` is the empirical quantile at level ``q * (n + 1) / n``;
``mean_of(d)`` is the exact expectation of ``sample(d, ...)`` (closed form for the
truncated lognormal); ``rescaled(d, m)`` multiplies every draw by one factor, so the shape
(every quantile ratio) is unchanged and the mean becomes ``m``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import ndtr, ndtri

DEFAULT_MAX_FACTOR = 4.0


@dataclass(frozen=True)
class EmpiricalTail:
    """Body of observations plus a conditioned lognormal tail, all multiplied by ``scale``.

    ``body`` is the sorted observations, ``threshold`` the largest; the tail is
    lognormal(``log_mu``, ``log_sigma``) restricted to ``(threshold, cap]``.
    """

    body: tuple[float, ...]
    threshold: float
    tail_fraction: float
    log_mu: float
    log_sigma: float
    num_observations: int
    cap: float
    scale: float = 1.0


def fit_distribution(values: ArrayLike, max_factor: float = DEFAULT_MAX_FACTOR) -> EmpiricalTail:
    """Fit the body-and-tail rule to positive observations (at least two distinct)."""
    x = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if x.size < 2:
        raise ValueError(f"need at least 2 observations, got {x.size}")
    if not np.all(np.isfinite(x)) or x[0] <= 0:
        raise ValueError("observations must be finite and > 0")
    if not max_factor > 1.0:
        raise ValueError(f"max_factor must be > 1, got {max_factor}")
    logs = np.log(x)
    sigma = float(np.std(logs))
    if sigma <= 0:
        raise ValueError("observations must not all be equal")
    return EmpiricalTail(
        body=tuple(float(v) for v in x),
        threshold=float(x[-1]),
        tail_fraction=1.0 / (x.size + 1),
        log_mu=float(np.mean(logs)),
        log_sigma=sigma,
        num_observations=int(x.size),
        cap=float(x[-1]) * max_factor,
    )


def _bounds(d: EmpiricalTail) -> tuple[float, float]:
    """Standardised log bounds ``(a, b)`` of the tail: threshold and cap."""
    a = (math.log(d.threshold) - d.log_mu) / d.log_sigma
    b = (math.log(d.cap) - d.log_mu) / d.log_sigma
    return a, b


def sample(d: EmpiricalTail, rng: np.random.Generator, size: int) -> NDArray[np.float64]:
    """``size`` independent draws; consumes exactly two uniforms per draw from ``rng``."""
    u = rng.random(size)
    v = rng.random(size)
    body = np.asarray(d.body, dtype=np.float64)
    in_body = u < 1.0 - d.tail_fraction
    idx = np.minimum((u / (1.0 - d.tail_fraction) * body.size).astype(np.int64), body.size - 1)
    a, b = _bounds(d)
    p_a, p_b = float(ndtr(a)), float(ndtr(b))
    # inverse CDF of the normal restricted to (a, b]; the clip keeps ndtri finite
    z = ndtri(np.clip(p_a + v * (p_b - p_a), 1e-300, 1.0 - 1e-16))
    tail = np.clip(np.exp(d.log_mu + d.log_sigma * z), d.threshold, d.cap)
    return np.where(in_body, body[idx], tail) * d.scale


def tail_mean(d: EmpiricalTail) -> float:
    """E[X | threshold < X <= cap] of the unscaled lognormal (closed form)."""
    a, b = _bounds(d)
    mass = float(ndtr(b) - ndtr(a))
    if mass <= 1e-300:  # the interval lies far out in the lognormal's tail
        return d.threshold
    s = d.log_sigma
    partial = float(ndtr(s - a) - ndtr(s - b))
    return math.exp(d.log_mu + s**2 / 2.0) * partial / mass


def mean_of(d: EmpiricalTail) -> float:
    """The exact mean of ``sample(d, ...)``."""
    body_mean = float(np.mean(d.body))
    unscaled = (1.0 - d.tail_fraction) * body_mean + d.tail_fraction * tail_mean(d)
    return unscaled * d.scale


def rescaled(d: EmpiricalTail, mean: float) -> EmpiricalTail:
    """The same shape with mean ``mean`` (every draw multiplied by one factor)."""
    if not mean > 0:
        raise ValueError(f"mean must be > 0, got {mean}")
    return replace(d, scale=d.scale * mean / mean_of(d))
