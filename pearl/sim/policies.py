"""The policies a simulated run can be driven by: pearl and the baselines, one registry.

Every policy decides through the same ``pearl.core.decide()``, with its own
``PolicyConfig`` (rules by name, selection modes); the simulator runs all of them
through the same engines, trainer and Slurm. ``docs/baselines.md`` says what each
models and its public source. The run's first decision places the initial
configuration whatever the switching rule (``bootstrap``): the job has just started.

- ``pearl``: the scenario's policy configuration.
- ``roll-fixed``: fixed-resource ROLL: the base rollout GPUs, colocated, held; no
  elastic GPUs, no borrowing.
- ``roll-partial``: ROLL's partial-GPU mode: as roll-fixed, and the trainer's GPUs run
  colocated instances between its updates (lent when it waits, taken back with in-flight
  requests migrated when the batch is ready); no cost model.
- ``rlboost-plus``: RLBoost carried to this setting: colocated only, every elastic GPU it
  can get (instances pull weights when they join, requests migrate on preemption), and
  its feedback controller of the local rollout budget: the share of the trainer's nodes
  lent between updates grows by one node after an update the trainer did not wait for
  and halves after one it waited for (AIMD).
- ``static-pd-colocated`` / ``static-pd-disaggregated``: the base rollout GPUs held in one
  PD mode, its ratio chosen by the predictor at the start; ``static-pd`` reports the
  better of the two for each seed (the best static mode in hindsight).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pearl.core.config import PolicyConfig


@dataclass
class SimPolicy:
    name: str
    base: PolicyConfig
    controller: Callable[[SimPolicy, float], None] | None = None
    lend_fraction: float = 1.0
    history: list[float] = field(default_factory=list)  # the trainer's waits

    def config(self, bootstrap: bool = False) -> PolicyConfig:
        cfg = self.base
        if self.lend_fraction != cfg.borrowing.lend_fraction:
            borrowing = cfg.borrowing.model_copy(update={"lend_fraction": self.lend_fraction})
            cfg = cfg.model_copy(update={"borrowing": borrowing})
        if bootstrap:
            switching = cfg.switching.model_copy(update={"rule": "always"})
            cfg = cfg.model_copy(update={"switching": switching})
        return cfg

    def on_train_step(self, waited_s: float) -> None:
        self.history.append(waited_s)
        if self.controller is not None:
            self.controller(self, waited_s)


def _fixed(
    pearl: PolicyConfig, modes: str, borrowing: str = "never", elastic: str = "never"
) -> PolicyConfig:
    return pearl.model_copy(
        update={
            "policy": "pearl",
            "selection": pearl.selection.model_copy(update={"modes": modes}),
            "switching": pearl.switching.model_copy(update={"rule": "never"}),
            "borrowing": pearl.borrowing.model_copy(update={"rule": borrowing}),
            "elastic": pearl.elastic.model_copy(update={"rule": elastic}),
        }
    )


def _aimd(policy: SimPolicy, waited_s: float, num_nodes: int) -> None:
    """RLBoost's local-budget feedback: back off when the trainer waited, else grow."""
    step = 1.0 / num_nodes
    if waited_s > policy.base.borrowing.max_return_delay_s / 2:
        policy.lend_fraction = max(step, math.floor(policy.lend_fraction * num_nodes / 2) * step)
    else:
        policy.lend_fraction = min(1.0, policy.lend_fraction + step)


def make_policy(name: str, pearl: PolicyConfig, trainer_nodes: int) -> SimPolicy:
    """A fresh policy object (controllers keep state, so one per run)."""
    if name == "pearl":
        return SimPolicy(name, pearl)
    if name == "roll-fixed":
        return SimPolicy(name, _fixed(pearl, "colocated"))
    if name == "roll-partial":
        return SimPolicy(name, _fixed(pearl, "colocated", borrowing="always"))
    if name == "rlboost-plus":
        cfg = _fixed(pearl, "colocated", borrowing="always", elastic="greedy")
        return SimPolicy(
            name,
            cfg,
            controller=lambda p, w: _aimd(p, w, trainer_nodes),
            lend_fraction=1.0 / trainer_nodes,
        )
    if name.startswith("static-pd-"):
        return SimPolicy(name, _fixed(pearl, name.removeprefix("static-pd-")))
    raise KeyError(name)


RUN_POLICIES = (
    "pearl",
    "roll-fixed",
    "roll-partial",
    "rlboost-plus",
    "static-pd-colocated",
    "static-pd-disaggregated",
)
REPORTED = ("pearl", "roll-fixed", "roll-partial", "rlboost-plus", "static-pd", "oracle")
