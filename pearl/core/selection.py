"""PD mode and ratio selection under a GPU budget.

Candidates:
- colocated: every GPU type runs colocated instances of one TP degree; every combination
  of feasible degrees per type (capped, see ``_MAX_TP_COMBOS``);
- disaggregated: for every pair (prefill TP, decode TP), every split of the budget into P
  prefill and D decode instances. GPU types are ordered by their comparative advantage
  at prefill (prefill throughput over decode throughput per GPU, from the profile);
  prefill instances fill the most prefill-suited types first, node by node, and decode
  instances take every GPU left. With heterogeneous GPUs this places prefill and decode
  where the profile says each runs best; with one type it is the plain P:D split.

``SelectionConfig.modes`` keeps only one of the two families (a baseline that never
disaggregates, or one held to a disaggregated split).

When the candidates number at most ``exhaustive_limit`` every one is predicted, in one
batch. Above it, each TP pair is first probed on a geometric grid of splits, the best
pairs are kept and their bracket (the neighbours of the best grid point) is refined by
an even grid per round, all pairs in one batch per round, until every split of the
bracket is predicted. This finds the best split when the predicted time is unimodal in
P, which the fluid predictor's prefill/decode balance makes it in practice (a test
compares against exhaustive search); rounds are batches so the predictor can vectorise.

Invariants: every returned configuration fits the budget (per type, instances pack onto
the nodes); ``ranked`` is sorted by effective completion, best first: the predicted
completion when the caller supplies no ``reach``, else what ``reach`` makes of it (the
transition, less what the engines it keeps serve meanwhile:
``transition_cost.effective_completion_s``); ties are broken by the smaller predicted
completion (the configuration that serves the next batch faster), then by fewer GPUs,
then by the configuration's order, so selection is deterministic.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from pearl.core.config import SelectionConfig
from pearl.core.pd import GpuBudget, InstanceSpec, PDConfig, fits_budget
from pearl.core.predictor import Prediction, PreparedWorkload, predict_prepared_many
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import Role

_MAX_TP_COMBOS = 64
_GRID_POINTS = 7  # first probe of every TP pair, geometric
_REFINE_POINTS = 17  # per bracket and round, even
_PAIRS_REFINED = 2


class Reached(NamedTuple):
    """What reaching a configuration costs: its transition, the share of the running
    configuration's GPUs kept serving through it, and its completion with both counted
    (``transition_cost.effective_completion_s``)."""

    transition_s: float
    kept_share: float
    effective_s: float


class Reach(Protocol):
    """How reaching a configuration counts: ``reach(config, completion_s)``; no
    candidate's effective completion is below the smaller of its own completion and
    ``floor_s`` (read once predictions are made)."""

    def __call__(self, config: PDConfig, completion_s: float) -> Reached: ...

    @property
    def floor_s(self) -> float: ...


class _Instantly:
    """No transition: the effective completion is the predicted one."""

    floor_s = math.inf

    def __call__(self, config: PDConfig, completion_s: float) -> Reached:
        return Reached(0.0, 0.0, completion_s)


@dataclass(frozen=True)
class Candidate:
    config: PDConfig
    prediction: Prediction
    transition_s: float  # estimated time until the configuration serves
    kept_share: float  # of the running configuration's GPUs, serving through the transition
    effective_s: float  # completion from now, the transition included: what ranks

    @property
    def completion_s(self) -> float:
        return self.prediction.completion_s


@dataclass(frozen=True)
class Selection:
    best: Candidate
    ranked: tuple[Candidate, ...]  # the top candidates, best first
    num_evaluated: int
    exhaustive: bool
    notes: tuple[str, ...]  # e.g. GPU types the profile does not know
    min_critical_path_s: float  # shortest critical path of any evaluated candidate

    @property
    def reason(self) -> str:
        runner_up = self.ranked[1] if len(self.ranked) > 1 else None
        text = f"best {self.best.config.label()}: {_times(self.best)}"
        if runner_up is not None:
            text += f"; next {runner_up.config.label()}: {_times(runner_up)}"
        return f"{text} ({self.num_evaluated} candidates)"


def select_pd(
    prepared: PreparedWorkload,
    budget: GpuBudget,
    cfg: SelectionConfig,
    extra: Sequence[PDConfig] = (),
    reach: Reach | None = None,
    known: dict[PDConfig, Prediction] | None = None,
) -> Selection:
    """The configuration with the smallest predicted completion time, and the runners-up.

    ``prepared``: the workload prepared once per decision (``predictor.prepare``), with
    its profile. ``extra`` configurations (e.g. the one running now) are ranked alongside
    when they fit the budget. With ``reach``, candidates rank by their completion with
    the transition counted, so a target whose transition would eat its gain loses to a
    cheaper one.
    ``known``: predictions of this workload made before (a prediction does not depend on
    the budget), read and extended.
    """
    profile = prepared.profile
    known = {} if known is None else known
    evaluated: dict[PDConfig, Prediction] = {}

    def evaluate(configs: Sequence[PDConfig]) -> list[float]:
        new = [c for c in dict.fromkeys(configs) if c not in evaluated and c not in known]
        known.update(zip(new, predict_prepared_many(prepared, new), strict=True))
        evaluated.update((c, known[c]) for c in configs)
        return [evaluated[c].completion_s for c in configs]

    notes = tuple(
        f"GPU type {t!r} is not in the profile; unused"
        for t in budget.types()
        if t not in profile.gpus
    )
    shape = _BudgetShape(budget, profile)
    layouts = [_SplitLayout(shape, profile, tp_p, tp_d) for tp_p, tp_d in _tp_pairs(shape)]
    layouts = [lay for lay in layouts if lay.max_prefill >= 1 and cfg.modes != "colocated"]
    colocated = _colocated_configs(shape) if cfg.modes != "disaggregated" else []
    fitting_extra = [
        c
        for c in extra
        if c.instances and fits_budget(c, budget) and cfg.modes in ("any", c.mode.value)
    ]
    num_candidates = len(colocated) + sum(lay.max_prefill for lay in layouts)
    exhaustive = num_candidates <= cfg.exhaustive_limit
    if exhaustive:
        every_split = [lay.config(p) for lay in layouts for p in range(1, lay.max_prefill + 1)]
        evaluate([*fitting_extra, *colocated, *every_split])
    else:
        _search_splits(layouts, evaluate, first=[*fitting_extra, *colocated])
    if not evaluated:
        evaluate([PDConfig()])
    candidates = _rank(evaluated, reach or _Instantly(), cfg.top_k)
    min_critical_s = min(p.breakdown.critical_path_s for p in evaluated.values())
    return Selection(candidates[0], candidates, len(evaluated), exhaustive, notes, min_critical_s)


def _rank(evaluated: dict[PDConfig, Prediction], reach: Reach, top_k: int) -> tuple[Candidate, ...]:
    """The ``top_k`` candidates by effective completion. They are reached in order of
    completion, and no further once the smaller of a completion and ``reach.floor_s``
    exceeds the ``top_k``-th best effective time: no later candidate can enter."""
    by_completion = sorted(evaluated.items(), key=lambda kv: (kv[1].completion_s, kv[0]))
    scored: list[Candidate] = []
    floor_s: float | None = None
    for config, prediction in by_completion:
        completion_s = prediction.completion_s
        if len(scored) >= top_k:
            kth_s = sorted(c.effective_s for c in scored)[top_k - 1]
            floor_s = reach.floor_s if floor_s is None else floor_s
            if min(completion_s, floor_s) > kth_s:
                break
        reached = (
            reach(config, completion_s) if completion_s < math.inf else Reached(0, 0, math.inf)
        )
        scored.append(Candidate(config, prediction, *reached))
    # Equal effective times (the batch ends on the kept engines before an addition
    # serves): the faster configuration, which serves the next batch; then fewer GPUs.
    scored.sort(key=lambda c: (c.effective_s, c.completion_s, c.config.num_gpus, c.config))
    return tuple(scored[:top_k])


def _times(c: Candidate) -> str:
    return (
        f"{c.completion_s:.1f} s predicted, {c.transition_s:.1f} s transition, "
        f"{c.effective_s:.1f} s with it"
    )


Evaluate = Callable[[Sequence[PDConfig]], list[float]]


def _search_splits(
    layouts: Sequence[_SplitLayout], evaluate: Evaluate, first: list[PDConfig]
) -> None:
    """A coarse grid over every TP pair (one batch with ``first``), then the best pairs'
    brackets are refined, all pairs together, a grid of points per round."""
    grids = [_grid(1, lay.max_prefill, geometric=True) for lay in layouts]
    times = evaluate(
        [*first, *(lay.config(p) for lay, g in zip(layouts, grids, strict=True) for p in g)]
    )
    times = times[len(first) :]
    brackets: list[tuple[float, _SplitLayout, tuple[int, int]]] = []
    for lay, grid in zip(layouts, grids, strict=True):
        t, times = times[: len(grid)], times[len(grid) :]
        brackets.append((min(t), lay, _bracket(grid, t, lay.max_prefill)))
    brackets.sort(key=lambda b: b[0])
    active = [(lay, br) for _, lay, br in brackets[:_PAIRS_REFINED]]
    while active:
        grids = [_grid(lo, hi, geometric=False) for _, (lo, hi) in active]
        times = evaluate(
            [lay.config(p) for (lay, _), g in zip(active, grids, strict=True) for p in g]
        )
        narrowed = []
        for (lay, (lo, hi)), grid in zip(active, grids, strict=True):
            t, times = times[: len(grid)], times[len(grid) :]
            if hi - lo + 1 > len(grid):  # not yet every point of the bracket
                narrowed.append((lay, _bracket(grid, t, hi)))
        active = narrowed


def _bracket(grid: list[int], times: list[float], hi: int) -> tuple[int, int]:
    """The neighbours of the grid's best point (ties to the smaller split)."""
    best = min(range(len(grid)), key=lambda i: (times[i], grid[i]))
    lo = grid[best - 1] if best > 0 else grid[0]
    return lo, grid[best + 1] if best + 1 < len(grid) else hi


def _grid(lo: int, hi: int, *, geometric: bool) -> list[int]:
    """A few splits over lo..hi, both ends included: geometric for the first probe."""
    num_points = _GRID_POINTS if geometric else _REFINE_POINTS
    if hi - lo + 1 <= num_points:
        return list(range(lo, hi + 1))
    n = num_points - 1
    if geometric:
        points = (lo * (hi / lo) ** (i / n) for i in range(n + 1))
    else:
        points = (lo + (hi - lo) * i / n for i in range(n + 1))
    return sorted({max(lo, min(hi, round(p))) for p in points})


def _usable_tps(budget: GpuBudget, profile: RuntimeProfile, gpu_type: str) -> tuple[int, ...]:
    biggest_node = max(budget.node_sizes(gpu_type), default=0)
    return tuple(tp for tp in profile.feasible_tps(gpu_type) if tp <= biggest_node)


class _BudgetShape:
    """What the candidates of a budget are made from, per GPU type, read once per
    selection (a budget of thousands of GPUs lists a thousand nodes): the usable TP
    degrees, the nodes as (free GPUs, how many nodes) largest first, and the type's
    prefill advantage."""

    def __init__(self, budget: GpuBudget, profile: RuntimeProfile) -> None:
        self.types = budget.types()
        self.usable_tps = {t: _usable_tps(budget, profile, t) for t in self.types}
        self.nodes = {
            t: sorted(Counter(budget.node_sizes(t)).items(), reverse=True) for t in self.types
        }
        self.advantage = {t: prefill_advantage(profile, t) for t in self.types}


def _colocated_configs(shape: _BudgetShape) -> list[PDConfig]:
    types = [t for t in shape.types if shape.usable_tps[t]]
    choices = [shape.usable_tps[t] for t in types]
    combos = list(itertools.islice(itertools.product(*choices), _MAX_TP_COMBOS))
    configs = []
    for combo in combos:
        counts = {
            InstanceSpec(Role.COLOCATED, t, tp): sum(n // tp * k for n, k in shape.nodes[t])
            for t, tp in zip(types, combo, strict=True)
        }
        configs.append(PDConfig.of(counts))
    return [c for c in configs if c.instances]


def _tp_pairs(shape: _BudgetShape) -> list[tuple[int, int]]:
    tps = sorted({tp for t in shape.types for tp in shape.usable_tps[t]})
    return list(itertools.product(tps, tps))


def prefill_advantage(profile: RuntimeProfile, gpu_type: str) -> float:
    """Prefill throughput over decode throughput per GPU at a reference operating point."""
    tps = profile.feasible_tps(gpu_type)
    if not tps:
        return 0.0
    eng = profile.engine(gpu_type, tps[0])
    assert eng is not None
    w = profile.workload
    ctx = w.prompt_tokens + w.turns_per_trajectory / 2 * (
        w.output_tokens_per_turn + w.observation_tokens_per_turn
    )
    prefill_s = float(eng.prefill.work_s(w.observation_tokens_per_turn + 1, ctx))
    prefill_per_s = 1.0 / max(prefill_s, 1e-12)
    batch = float(min(eng.max_num_seqs, 64))
    decode_per_s = batch / float(eng.decode.step_s(batch, batch * ctx))
    return prefill_per_s / decode_per_s


class _SplitLayout:
    """Disaggregated configurations of one TP pair, indexed by the prefill instance count."""

    def __init__(self, shape: _BudgetShape, profile: RuntimeProfile, tp_p: int, tp_d: int) -> None:
        self.tp_p, self.tp_d = tp_p, tp_d
        types = sorted(shape.types, key=lambda t: (-shape.advantage[t], t))
        self.types = [t for t in types if t in profile.gpus]
        self.prefill_ok = [tp_p in shape.usable_tps[t] for t in self.types]
        self.decode_ok = [tp_d in shape.usable_tps[t] for t in self.types]
        # Per type, its nodes as (free GPUs, how many nodes), largest first.
        self.nodes = [shape.nodes[t] for t in self.types]
        # Cumulative prefill slots over the types in order, and per type over its nodes.
        self.type_slots = [
            sum(n // tp_p * k for n, k in ns) if ok else 0
            for ns, ok in zip(self.nodes, self.prefill_ok, strict=True)
        ]
        self.cum_type_slots = list(itertools.accumulate(self.type_slots, initial=0))
        # The most prefill instances that still leave a decode instance (the decode count
        # never grows with the prefill count, so bisect).
        lo, hi = 0, self.cum_type_slots[-1]
        if self._decode_count(0) == 0:
            hi = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._decode_count(mid) > 0 else (lo, mid - 1)
        self.max_prefill = lo

    def _split(self, num_prefill: int) -> tuple[list[int], list[int]]:
        """Per type: prefill instances and decode instances."""
        prefill, decode = [], []
        for i, ns in enumerate(self.nodes):
            p_here = min(max(num_prefill - self.cum_type_slots[i], 0), self.type_slots[i])
            prefill.append(p_here)
            decode.append(self._decode_on(ns, p_here) if self.decode_ok[i] else 0)
        return prefill, decode

    def _decode_on(self, groups: list[tuple[int, int]], num_prefill: int) -> int:
        """Decode instances left on nodes once prefill filled them in order."""
        tp_p, tp_d = self.tp_p, self.tp_d
        left, count = num_prefill, 0
        for size, num_nodes in groups:
            per_node = size // tp_p
            full = min(num_nodes, left // per_node) if per_node else 0
            left -= full * per_node
            count += full * ((size - per_node * tp_p) // tp_d)
            rest = num_nodes - full
            if rest and left > 0:  # one node partly used by prefill
                count += (size - left * tp_p) // tp_d
                left, rest = 0, rest - 1
            count += rest * (size // tp_d)
        return count

    def _decode_count(self, num_prefill: int) -> int:
        return sum(self._split(num_prefill)[1])

    def config(self, num_prefill: int) -> PDConfig:
        prefill, decode = self._split(num_prefill)
        counts: dict[InstanceSpec, int] = {}
        for t, p, d in zip(self.types, prefill, decode, strict=True):
            counts[InstanceSpec(Role.PREFILL, t, self.tp_p)] = p
            counts[InstanceSpec(Role.DECODE, t, self.tp_d)] = d
        return PDConfig.of(counts)
