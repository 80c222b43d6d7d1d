"""The predictor calibrated online against the batch times a run measures (pure).

A profile fitted on an idle engine (``pearl profile fit``) can be far from what the same
engine delivers inside a run, where it shares its machine with the rest of the data
plane (on a CPU machine: the trainer's updates, the router and the rollout on the same
cores; on a GPU cluster: contention the sweep never saw). ``BatchCalibration`` keeps
the ratio of each completed batch's measured duration to its predicted one, smoothed
(an exponentially weighted mean of the logarithm: a ratio of 2 and one of 1/2 cancel),
and ``scaled_engines`` applies it to the profile's engine costs (prefill and decode, every
GPU type and TP degree; the transition costs and the workload are measured separately and
stay). The ratio is bounded, so one odd batch cannot swing the next decisions far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pearl.core.profile import DecodeRegime, EngineProfile, RuntimeProfile


@dataclass
class BatchCalibration:
    """Measured over predicted batch time, smoothed; ``factor`` is 1.0 before any batch.
    Each batch moves the factor's logarithm ``weight`` of the way to the one that would
    have predicted it exactly."""

    weight: float = 0.3  # of the newest batch
    min_factor: float = 0.25
    max_factor: float = 8.0
    log_factor: float = 0.0
    batches: int = 0

    @property
    def factor(self) -> float:
        return math.exp(self.log_factor)

    def observe(self, predicted_s: float, measured_s: float, used_factor: float) -> float:
        """One completed batch, predicted with the profile scaled by ``used_factor``: the
        new factor. Batches without a usable pair change nothing."""
        usable = predicted_s > 0 and measured_s > 0 and used_factor > 0
        if not (usable and math.isfinite(predicted_s) and math.isfinite(used_factor)):
            return self.factor
        target = math.log(used_factor) + math.log(measured_s / predicted_s)
        mixed = (1 - self.weight) * self.log_factor + self.weight * target
        self.log_factor = min(max(mixed, math.log(self.min_factor)), math.log(self.max_factor))
        self.batches += 1
        return self.factor


def scaled_engines(profile: RuntimeProfile, factor: float) -> RuntimeProfile:
    """``profile`` with every engine's prefill and decode costs multiplied by ``factor``."""
    if factor <= 0 or not math.isfinite(factor):
        raise ValueError(f"factor: {factor} is not a positive number")

    def regime(r: DecodeRegime) -> DecodeRegime:
        return DecodeRegime(
            base_s=r.base_s * factor,
            per_seq_s=r.per_seq_s * factor,
            per_ctx_token_s=r.per_ctx_token_s * factor,
        )

    def engine(e: EngineProfile) -> EngineProfile:
        p = e.prefill
        prefill = p.model_copy(
            update={
                "a_s": p.a_s * factor,
                "b_s_per_token": p.b_s_per_token * factor,
                "c_s_per_token2": p.c_s_per_token2 * factor,
            }
        )
        d = e.decode
        decode = d.model_copy(update={"small": regime(d.small), "large": regime(d.large)})
        return e.model_copy(update={"prefill": prefill, "decode": decode})

    gpus = {
        t: g.model_copy(update={"engines": tuple(engine(e) for e in g.engines)})
        for t, g in profile.gpus.items()
    }
    return profile.model_copy(update={"gpus": gpus})
