"""Switching rules: whether to move from the running PD configuration to the best one.

``margin`` (the default) switches only when the predicted time saved exceeds the
transition's makespan plus an absolute and a relative margin, and not sooner than the
minimum dwell time after the previous switch (no flapping). A *mandatory* change (the
GPU pool changed: a grant, a preemption, a lend or a return) is always made; a change
of PD mode with it meets the margins first (``decide._mode_held``).

Invariant: with the same inputs a rule returns the same verdict; ``never`` switches only
when the change is mandatory and ``always`` whenever the target differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pearl.core.config import SwitchingConfig
from pearl.core.decision import SwitchVerdict


@dataclass(frozen=True)
class SwitchInput:
    current_s: float  # predicted completion with the running configuration
    target_s: float  # predicted completion with the best configuration
    cost_s: float  # makespan of the transition plan
    mandatory: bool  # the pool changed: the running configuration no longer fits
    last_switch_s: float | None
    now_s: float

    @property
    def gain_s(self) -> float:
        return self.current_s - self.target_s


SwitchRule = Callable[[SwitchInput, SwitchingConfig], SwitchVerdict]


def margin_rule(x: SwitchInput, cfg: SwitchingConfig) -> SwitchVerdict:
    if x.mandatory:
        return SwitchVerdict(True, True, x.gain_s, x.cost_s, "the GPU pool changed")
    if x.last_switch_s is not None and x.now_s - x.last_switch_s < cfg.min_dwell_s:
        wait_s = cfg.min_dwell_s - (x.now_s - x.last_switch_s)
        return SwitchVerdict(False, False, x.gain_s, x.cost_s, f"dwell: {wait_s:.0f} s to go")
    needed_s = x.cost_s + cfg.min_gain_s + cfg.min_gain_fraction * x.current_s
    verdict = x.gain_s > needed_s
    word = ">" if verdict else "<="
    reason = f"saves {x.gain_s:.1f} s {word} {needed_s:.1f} s needed (transition {x.cost_s:.1f} s)"
    return SwitchVerdict(verdict, False, x.gain_s, x.cost_s, reason)


def always_rule(x: SwitchInput, cfg: SwitchingConfig) -> SwitchVerdict:
    return SwitchVerdict(True, x.mandatory, x.gain_s, x.cost_s, "always switch")


def never_rule(x: SwitchInput, cfg: SwitchingConfig) -> SwitchVerdict:
    reason = "the GPU pool changed" if x.mandatory else "switching disabled"
    return SwitchVerdict(x.mandatory, x.mandatory, x.gain_s, x.cost_s, reason)


SWITCH_RULES: dict[str, SwitchRule] = {
    "margin": margin_rule,
    "always": always_rule,
    "never": never_rule,
}
