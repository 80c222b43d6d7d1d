"""The first-completed oracle's per-trajectory lower bounds against brute force over the
profile's own cost functions: own time and work exactly, the blended cost never above."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import sim_fixtures as F

from pearl.core.profile import EngineProfile
from pearl.sim.oracle_costs import CostModel, Lines
from pearl.sim.trajectories import TrajectorySpec

SPECS = [
    TrajectorySpec(1, (0,), (1,), ()),
    TrajectorySpec(3000, (0, 400, 50), (200, 7, 1500), (0.5, 2.0)),
    TrajectorySpec(20000, (0, 9000), (3000, 40), (11.0,)),
]


def _engines() -> list[EngineProfile]:
    prof = F.profile()
    return [e for g in ("h800", "h20") for e in prof.gpus[g].engines]


def _turns(spec: TrajectorySpec) -> list[tuple[int, int, int]]:
    """(new tokens, whole context of the turn's prompt, output tokens) per turn."""
    out, ctx = [], spec.prompt_tokens
    for i, o in enumerate(spec.output_tokens):
        n = spec.prompt_tokens if i == 0 else spec.new_tokens[i]
        if i:
            ctx += spec.new_tokens[i]
        out.append((n, ctx, o))
        ctx += o
    return out


def _brute(spec: TrajectorySpec, mu: float) -> tuple[float, float, float]:
    """(own s, work GPU-s, blended) by enumeration: every token at every engine and
    integer batch size, with the step functions of the profile."""
    tool_s = sum(spec.tool_latency_s)
    own, work, blended = tool_s, 0.0, mu * tool_s
    for n, ctx, o in _turns(spec):
        p = ctx - n  # the most that can be cached
        own += min(e.prefill.batch_s([n], [p]) for e in _engines())
        work += min(e.tp * float(e.prefill.work_s([n], [p])[0]) for e in _engines())
        blended += min(
            e.tp * float(e.prefill.work_s([n], [p])[0]) + mu * e.prefill.batch_s([n], [p])
            for e in _engines()
        )
        contexts = np.arange(ctx, ctx + o, dtype=float)
        best_s = np.full(o, np.inf)
        best_gpu_s = np.full(o, np.inf)
        best_blend = np.full(o, np.inf)
        for e in _engines():
            for m in range(1, e.max_num_seqs + 1):
                step_own = e.decode.step_s(m, contexts)  # m sequences, the others at 0
                best_s = np.minimum(best_s, step_own)
                step_all = e.decode.step_s(m, m * contexts)  # m sequences at this context
                best_gpu_s = np.minimum(best_gpu_s, e.tp * step_all / m)
                # m of them in a step: each pays a GPU share and waits the whole step
                best_blend = np.minimum(best_blend, e.tp * step_all / m + mu * step_all)
        own += float(best_s.sum())
        work += float(best_gpu_s.sum())
        blended += float(best_blend.sum())
    return own, work, blended


def test_lines_envelope_is_the_minimum_of_its_lines() -> None:
    lines = [(5.0, 0.0), (1.0, 1.0), (0.0, 3.0), (2.5, 0.5), (9.0, 0.0)]
    env = Lines.envelope(lines)
    assert env.starts_tokens[0] == 0
    assert list(env.starts_tokens) == sorted(set(env.starts_tokens))
    ctx = np.arange(0.0, 60.0)
    brute = np.min([c0 + c1 * ctx for c0, c1 in lines], axis=0)
    assert [env.at(x) for x in ctx] == pytest.approx(brute)
    for first, count in itertools.product((0, 1, 3, 7, 20), (1, 2, 9, 30)):
        sums = env.token_sums(np.array([float(first)]), np.array([float(count)]))
        assert sums[0] == pytest.approx(brute[first : first + count].sum())


@pytest.mark.parametrize("spec", SPECS)
def test_own_time_and_work_are_the_brute_force_minimum(spec: TrajectorySpec) -> None:
    model = CostModel(_engines(), mus=(0.05,))
    c = model.costs([spec])
    own, work, _ = _brute(spec, 0.05)
    assert c.own_s[0] == pytest.approx(own, rel=1e-9)
    assert c.work_gpu_s[0] == pytest.approx(work, rel=1e-9)


@pytest.mark.parametrize("mu", [0.001, 0.05, 3.0])
@pytest.mark.parametrize("spec", SPECS)
def test_blended_cost_is_a_lower_bound_and_close(spec: TrajectorySpec, mu: float) -> None:
    c = CostModel(_engines(), mus=(mu,)).costs([spec])
    _, _, blended = _brute(spec, mu)
    assert c.blended_gpu_s[0, 0] <= blended * (1 + 1e-12)
    assert c.blended_gpu_s[0, 0] >= 0.99 * blended  # the relaxations lose little


def test_costs_of_many_are_the_costs_of_each() -> None:
    model = CostModel(_engines(), mus=(0.01, 0.1))
    together = model.costs(SPECS)
    for i, s in enumerate(SPECS):
        alone = model.costs([s])
        assert together.own_s[i] == pytest.approx(alone.own_s[0])
        assert together.work_gpu_s[i] == pytest.approx(alone.work_gpu_s[0])
        assert together.blended_gpu_s[i] == pytest.approx(alone.blended_gpu_s[0])
