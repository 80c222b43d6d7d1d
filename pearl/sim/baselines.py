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
  its feedback controller of the local rollout budget: the trainer's nodes lent between
  updates start at one, halve after an update the trainer waited for longer than half
  of ``max_return_delay_s``, and grow by one after any other (AIMD).
- ``static-pd-disaggregated``: the base rollout GPUs held disaggregated, the ratio chosen
  by the predictor at the start; ``static-pd`` reports, for each seed, the better of it
  and ``roll-fixed`` (the same held colocated), the best static mode in hindsight
  (``pearl.sim.report``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pearl.core.config import PolicyConfig


@dataclass
class SimPolicy:
    name: str
    base: PolicyConfig
    trainer_nodes: int = 1
    lent_nodes: int | None = None  # RLBoost's local budget; None: the config's share
    adaptive: bool = False  # the AIMD controller moves ``lent_nodes``

    def config(self, bootstrap: bool = False) -> PolicyConfig:
        cfg = self.base
        if self.lent_nodes is not None:
            share = self.lent_nodes / self.trainer_nodes
            borrowing = cfg.borrowing.model_copy(update={"lend_fraction": share})
            cfg = cfg.model_copy(update={"borrowing": borrowing})
        if bootstrap:
            switching = cfg.switching.model_copy(update={"rule": "always"})
            cfg = cfg.model_copy(update={"switching": switching})
        return cfg

    def on_train_step(self, waited_s: float) -> None:
        """RLBoost's feedback on the local rollout budget: halve the lent nodes after an
        update the trainer waited for (over half of ``max_return_delay_s``), else add one."""
        if not self.adaptive or self.lent_nodes is None:
            return
        if waited_s > self.base.borrowing.max_return_delay_s / 2:
            self.lent_nodes = max(1, self.lent_nodes // 2)
        else:
            self.lent_nodes = min(self.trainer_nodes, self.lent_nodes + 1)


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
        return SimPolicy(name, cfg, trainer_nodes, lent_nodes=1, adaptive=True)
    if name.startswith("static-pd-"):
        return SimPolicy(name, _fixed(pearl, name.removeprefix("static-pd-")))
    raise KeyError(name)


RUN_POLICIES = (
    "pearl",
    "roll-fixed",
    "roll-partial",
    "rlboost-plus",
    "static-pd-disaggregated",  # static-pd's colocated mode is roll-fixed
)
REPORTED = ("pearl", "roll-fixed", "roll-partial", "rlboost-plus", "static-pd", "oracle")
