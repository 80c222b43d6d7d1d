"""The inputs of one decision, with the derived views the policies share.

The workload is prepared for the predictor once; predictions are memoised per
configuration and selections per (budget, lending), so the elastic and borrowing rules
and the final selection can ask "what is the best configuration with these GPUs?"
without repeating the work.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from pearl.core.config import PolicyConfig
from pearl.core.observation import Observation
from pearl.core.pd import GpuBudget, PDConfig, config_of
from pearl.core.pool import Pool, node_counts, rollout_pool
from pearl.core.predictor import Prediction, PreparedWorkload, predict_prepared, prepare
from pearl.core.profile import RuntimeProfile
from pearl.core.selection import Reached, Selection, select_pd
from pearl.core.state import ClusterState, Gpu
from pearl.core.transition_cost import (
    Inventory,
    effective_completion_s,
    estimate_transition_s,
    kept_gpu_share,
    pool_inventory,
)


@dataclass
class DecisionContext:
    state: ClusterState  # already observed: events folded in
    obs: Observation
    cfg: PolicyConfig
    profile: RuntimeProfile
    now_s: float
    _selections: dict[tuple[GpuBudget, bool, str], Selection] = field(default_factory=dict)
    _predictions: dict[PDConfig, Prediction] = field(default_factory=dict)
    _pools: dict[tuple[frozenset[str], frozenset[str]], Pool] = field(default_factory=dict)
    _pools_state: ClusterState | None = None  # the state ``_pools`` were made from

    @cached_property
    def current_config(self) -> PDConfig:
        return config_of(self.state)

    @cached_property
    def prepared(self) -> PreparedWorkload:
        """The workload prepared once for every prediction of this decision."""
        return prepare(self.obs.workload, self.profile)

    @cached_property
    def lookahead(self) -> DecisionContext | None:
        """The same decision asked of the next batch and the one after it (the batch the
        next update admits: ``WorkloadSnapshot.lookahead``), or None when the workload has
        no such batch. GPUs that cannot shorten the next batch (it is nearly complete) may
        still shorten the one after: the elastic rule asks both before it lets them go.
        It is built on the state of its first use (the observed one: the elastic rule
        asks it before the borrowing rule changes the state)."""
        ahead = self.obs.workload.lookahead()
        if ahead is None:
            return None
        obs = self.obs.model_copy(update={"workload": ahead})
        return DecisionContext(self.state, obs, self.cfg, self.profile, self.now_s)

    @cached_property
    def current_prediction(self) -> Prediction:
        config = self.current_config
        if config not in self._predictions:
            self._predictions[config] = predict_prepared(self.prepared, config)
        return self._predictions[config]

    def trainer_gpu_ids(self) -> tuple[str, ...]:
        """The base-train GPUs, in the order of the state."""
        return self.state.base_train_gpu_ids

    def lent_gpu_ids(self) -> frozenset[str]:
        return self.state.lent_gpu_ids

    def rollout_gpus(self, lent: Iterable[str], excluded_allocations: Iterable[str] = ()) -> Pool:
        """GPUs rollout may use: base rollout, usable granted elastic ones, and lent ones
        (memoised per state: the rules and the final selection ask for the same pools)."""
        if self._pools_state is not self.state:
            self._pools, self._pools_state = {}, self.state
        key = (frozenset(lent), frozenset(excluded_allocations))
        if key not in self._pools:
            self._pools[key] = rollout_pool(self.state, *key)
        return self._pools[key]

    def budget(self, gpus: Iterable[Gpu], extra_nodes: Iterable[tuple[str, int]] = ()) -> GpuBudget:
        per_type: defaultdict[str, list[int]] = defaultdict(list)
        for (gpu_type, _), n in node_counts(gpus).items():
            per_type[gpu_type].append(n)
        for gpu_type, n in extra_nodes:
            per_type[gpu_type].append(n)
        return GpuBudget.of(per_type)

    def select(
        self,
        pool: Pool,
        lending: bool = False,
        extra_nodes: Sequence[tuple[str, int]] = (),
        modes: str | None = None,
    ) -> Selection:
        """Best configuration on a GPU pool, ranked by transition estimate plus prediction.

        ``lending``: reaching it starts with the trainer's offload. ``extra_nodes``:
        hypothetical (gpu_type, num_gpus) nodes, e.g. an elastic request not yet granted.
        ``modes``: the PD modes to choose among, when not the configuration's.
        """
        budget = self.budget(pool, extra_nodes)
        cfg = self.cfg.selection
        if modes is not None and modes != cfg.modes:
            cfg = cfg.model_copy(update={"modes": modes})
        key = (budget, lending, cfg.modes)
        if key not in self._selections:
            inv = pool_inventory(self.state, pool, lending)
            self._selections[key] = select_pd(
                self.prepared,
                budget,
                cfg,
                extra=[self.current_config],
                # The drain estimate needs the running configuration's prediction, which
                # this call makes among its first batch: read it only when ranking.
                reach=_Reaching(self, inv),
                known=self._predictions,
            )
        return self._selections[key]

    @cached_property
    def drain_estimate_s(self) -> float:
        """Expected time for in-flight turns to finish: one turn's decode at the running
        configuration's batch (a full turn: the worst case), or, when the running
        configuration cannot serve, one turn's decode at batch 1 on the fastest engine."""
        decode_s = self.current_prediction.breakdown.decode_s_per_turn
        if math.isfinite(decode_s) and decode_s > 0:
            return decode_s
        stats = self.obs.workload.turn_stats(self.profile.workload)
        step_s = min(
            (
                float(e.decode.step_s(1, stats.output_tokens_per_turn))
                for gpu in self.profile.gpus.values()
                for e in gpu.engines
            ),
            default=0.0,
        )
        return stats.output_tokens_per_turn * step_s


@dataclass(frozen=True)
class _Reaching:
    """``selection.Reach`` from the running configuration: the transition estimated on
    the pool's inventory, the engines the target keeps serving on meanwhile."""

    ctx: DecisionContext
    inv: Inventory

    def __call__(self, config: PDConfig, completion_s: float) -> Reached:
        ctx = self.ctx
        transition_s = estimate_transition_s(
            self.inv, config, ctx.profile.costs, ctx.drain_estimate_s
        )
        kept = kept_gpu_share(self.inv, config, ctx.current_config.num_gpus)
        current_s = ctx.current_prediction.completion_s
        effective_s = effective_completion_s(transition_s, kept, completion_s, current_s)
        return Reached(transition_s, kept, effective_s)

    @property
    def floor_s(self) -> float:
        """``effective_completion_s`` is never below min(target_s, current_s)."""
        return self.ctx.current_prediction.completion_s
