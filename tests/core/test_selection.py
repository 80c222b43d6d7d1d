from __future__ import annotations

import math

import numpy as np
import pytest

from pearl.bench.synth import build_workload
from pearl.core.config import SelectionConfig
from pearl.core.pd import GpuBudget, PDConfig, PDMode, fits
from pearl.core.predictor import prepare
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import Role
from pearl.core.selection import Reached, prefill_advantage, select_pd
from pearl.core.transition_cost import effective_completion_s
from pearl.core.workload import WorkloadSnapshot
from pearl.io.documents import load_profile


@pytest.fixture(scope="module")
def qwen8b() -> RuntimeProfile:
    return load_profile("qwen3-8b")


@pytest.fixture(scope="module")
def qwen30b() -> RuntimeProfile:
    return load_profile("qwen3-30b-a3b")


def _workload(n: int, seed: int = 0, **kw: float) -> WorkloadSnapshot:
    return build_workload(np.random.default_rng(seed), n, **kw)


def test_candidates_fit_the_budget(qwen8b: RuntimeProfile) -> None:
    budget = GpuBudget.of({"h100": [8, 8, 4], "h800": [8]})
    sel = select_pd(prepare(_workload(64), qwen8b), budget, SelectionConfig(top_k=1000))
    assert sel.exhaustive and sel.num_evaluated == len(sel.ranked)
    for cand in sel.ranked:
        for gpu_type, used in cand.config.gpus_by_type().items():
            assert used <= budget.num_gpus(gpu_type)
            tps = [
                s.tp for s, n in cand.config.instances if s.gpu_type == gpu_type for _ in range(n)
            ]
            assert fits(budget.node_sizes(gpu_type), tps)


def test_ranked_best_first_and_deterministic(qwen8b: RuntimeProfile) -> None:
    budget = GpuBudget.of({"h100": [8] * 4})
    a = select_pd(prepare(_workload(128), qwen8b), budget, SelectionConfig())
    b = select_pd(prepare(_workload(128), qwen8b), budget, SelectionConfig())
    times = [c.completion_s for c in a.ranked]
    assert times == sorted(times)
    assert a == b


def test_every_split_is_enumerated_on_a_small_budget(qwen8b: RuntimeProfile) -> None:
    budget = GpuBudget.of({"h100": [8]})
    sel = select_pd(prepare(_workload(32), qwen8b), budget, SelectionConfig(top_k=1000))
    splits = {
        (c.config.count(Role.PREFILL), c.config.count(Role.DECODE))
        for c in sel.ranked
        if c.config.mode is PDMode.DISAGGREGATED
    }
    tp1 = {(p, d) for p, d in splits if p + d == 8}
    assert tp1 == {(p, 8 - p) for p in range(1, 8)}
    assert any(c.config.mode is PDMode.COLOCATED for c in sel.ranked)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("turns", "prompt_tokens"),
    [(6.0, 2000.0), (30.0, 2000.0), (4.0, 8000.0)],
    ids=["short", "env-heavy", "long-context"],
)
@pytest.mark.parametrize(
    ("name", "nodes"),
    [
        pytest.param("qwen3-8b", {"h100": [8] * 12}, id="8b-h100"),
        pytest.param("qwen3-30b-a3b", {"h800": [8] * 6, "h20": [8] * 6}, id="30b-hetero"),
    ],
)
def test_search_finds_what_exhaustive_finds(
    name: str, nodes: dict[str, list[int]], turns: float, prompt_tokens: float, seed: int
) -> None:
    profile = load_profile(name)
    workload = _workload(300 + 100 * seed, seed, mean_turns=turns, prompt_tokens=prompt_tokens)
    prepared = prepare(workload, profile)
    budget = GpuBudget.of(nodes)
    full = select_pd(prepared, budget, SelectionConfig(exhaustive_limit=100_000))
    fast = select_pd(prepared, budget, SelectionConfig(exhaustive_limit=1))
    assert full.exhaustive and not fast.exhaustive
    assert fast.num_evaluated < full.num_evaluated / 4
    assert fast.best.completion_s <= full.best.completion_s * (1 + 1e-9)


def test_heterogeneous_prefill_goes_where_it_runs_best(qwen30b: RuntimeProfile) -> None:
    assert prefill_advantage(qwen30b, "h800") > prefill_advantage(qwen30b, "h20")
    budget = GpuBudget.of({"h800": [8, 8], "h20": [8, 8]})
    sel = select_pd(prepare(_workload(256), qwen30b), budget, SelectionConfig(top_k=1000))
    for cand in sel.ranked:
        if cand.config.mode is not PDMode.DISAGGREGATED:
            continue
        tp_p = next(s.tp for s, _ in cand.config.instances if s.role is Role.PREFILL)
        if tp_p not in qwen30b.feasible_tps("h800"):
            continue  # this prefill degree cannot run on h800 at all
        on_h20 = sum(
            n for s, n in cand.config.instances if s.role is Role.PREFILL and s.gpu_type == "h20"
        )
        spare_h800 = sum(
            s.tp * n
            for s, n in cand.config.instances
            if s.role is Role.DECODE and s.gpu_type == "h800"
        )
        assert not (on_h20 and spare_h800), cand.config.label()


def test_unknown_gpu_type_is_noted_not_used(qwen8b: RuntimeProfile) -> None:
    budget = GpuBudget.of({"h100": [8], "tpu": [8]})
    sel = select_pd(prepare(_workload(16), qwen8b), budget, SelectionConfig())
    assert "tpu" not in sel.best.config.gpus_by_type()
    assert any("tpu" in n for n in sel.notes)


def test_empty_budget_gives_an_infeasible_best(qwen8b: RuntimeProfile) -> None:
    sel = select_pd(prepare(_workload(16), qwen8b), GpuBudget.of({}), SelectionConfig())
    assert sel.best.completion_s == float("inf")


class _Scrambled:
    """A reach whose transitions are arbitrary (from the configuration's hash) but which
    keeps the promise of ``floor_s``: effective times never below min(completion, floor)."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s

    def __call__(self, config: PDConfig, completion_s: float) -> Reached:
        transition_s = float(hash(config) % 97)
        kept = (hash(config) % 5) / 4
        effective_s = effective_completion_s(transition_s, kept, completion_s, self.floor_s)
        return Reached(transition_s, kept, effective_s)


@pytest.mark.parametrize("floor_s", [1.0, 30.0, 80.0, math.inf])
def test_the_pruned_ranking_is_the_head_of_the_full_one(
    qwen8b: RuntimeProfile, floor_s: float
) -> None:
    """Candidates are reached in order of completion and the search stops once none can
    enter the top k; what it returns is the head of ranking every one."""
    budget = GpuBudget.of({"h100": [8] * 6})
    prepared = prepare(_workload(256), qwen8b)
    full = select_pd(prepared, budget, SelectionConfig(top_k=1_000), reach=_Scrambled(floor_s))
    for k in (1, 3, 8):
        head = select_pd(prepared, budget, SelectionConfig(top_k=k), reach=_Scrambled(floor_s))
        assert head.ranked == full.ranked[:k]
