"""How well the predictor answers the next-batch question (``WorkloadSnapshot.next_batch``):
the time until ``m`` more GRPO groups are complete, against a discrete reference.

    .venv/bin/python benchmarks/next_batch_check.py [--quick]

Two checks, printed as JSON (docs/predictor.md, "The next batch"):

1. ``discrete``: deterministic turns (every trajectory's turns, tokens and tool times are
   known exactly), served by ``pearl.sim.engine.EngineModel`` instances (vLLM-style
   continuous batching, per request and scheduler step) with sticky routing, from a cold
   start (every group queued) and from a warm snapshot taken mid-run (trajectories in
   every phase, groups partly done, fresh groups admitted at the snapshot). The truth is
   the time at which the m-th group completes in that run; the predictor sees the
   snapshot. Reported: the relative error for m over the groups, and that of the
   all-complete question (``next_batch`` None) on the same snapshot, the fluid's own error.
2. ``spread``: uncontended (far more instances than trajectories), trajectories drawn
   from the Qwen3-8B scenario's trace model; the truth is the mean over draws of the m-th
   group completion, each trajectory taking its own prefill, decode (batch 1) and tool
   times; the predictor sees the draws' per-turn moments (as the simulator's
   ``turn_stats``). ``fresh``: every trajectory queued (the order statistic alone);
   ``warm``: groups begun at uniform times over a mean trajectory's duration, seen then
   as the simulator's snapshot reports them (turns left from ``turns_left_table``, the
   env step's rest as the mean less the time spent), with the all-complete question on
   the same snapshots for comparison.
"""

from __future__ import annotations

import heapq
import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from pearl.core.pd import InstanceSpec, PDConfig
from pearl.core.predictor import predict_many
from pearl.core.profile import RuntimeProfile
from pearl.core.roles import Role
from pearl.core.workload import (
    NextBatch,
    TrajectoryProgress,
    TrajPhase,
    TurnStats,
    WorkloadSnapshot,
)
from pearl.io.documents import load_profile
from pearl.io.scenarios import load_scenario_and_profile
from pearl.io.simulation import run_inputs
from pearl.serving.requests import Request
from pearl.sim.engine import EngineModel, EngineStepResult
from pearl.sim.rollout import trajectory_stream
from pearl.sim.runner import trajectory_rng
from pearl.sim.trajectories import TrajectorySpec, turns_left_table

F64 = NDArray[np.float64]
SCENARIO = Path(__file__).resolve().parent / "scenarios" / "qwen3-8b.yaml"

GPU, TP = "h20", 1
OUT, OBS = 200, 500  # tokens per turn
DEFAULT_TURNS, PROMPT = 6, 1750  # the profile's defaults, for not-started trajectories


def colocated(k: int) -> PDConfig:
    return PDConfig.of({InstanceSpec(Role.COLOCATED, GPU, TP): k})


@dataclass
class Traj:
    """One deterministic trajectory: ``turns`` turns of OUT tokens, env ``env_s`` between."""

    traj_id: str
    group: int
    turns: int
    prompt: int
    instance: int
    done: int = 0  # turns finished
    ctx: int = 0  # context tokens so far
    phase: TrajPhase = TrajPhase.QUEUED
    env_end_s: float = 0.0
    finished_s: float | None = None
    request_id: str = ""


@dataclass
class Run:
    """A discrete run of deterministic trajectories on ``k`` colocated instances."""

    profile: RuntimeProfile
    k: int
    env_s: float
    trajs: dict[str, Traj] = field(default_factory=dict)
    now_s: float = 0.0

    def __post_init__(self) -> None:
        self.engines = [
            EngineModel.from_profile(Role.COLOCATED, self.profile, GPU, TP) for _ in range(self.k)
        ]
        self.busy_until: list[float | None] = [None] * self.k
        self.pending: dict[int, EngineStepResult] = {}  # the step each busy instance runs
        self.events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, id)
        self.seq = 0

    def admit(self, t: Traj, at_s: float) -> None:
        """Start ``t`` at ``at_s`` (now, if not later)."""
        t.ctx = t.prompt
        self.trajs[t.traj_id] = t
        if at_s <= self.now_s:
            self._submit(t)
        else:
            t.phase = TrajPhase.QUEUED
            self._push(at_s, "admit", t.traj_id)

    def _push(self, time_s: float, kind: str, ident: str) -> None:
        heapq.heappush(self.events, (time_s, self.seq, kind, ident))
        self.seq += 1

    def _submit(self, t: Traj) -> None:
        t.phase = TrajPhase.QUEUED
        t.request_id = f"{t.traj_id}/{t.done}"
        self.engines[t.instance].submit(Request(t.request_id, t.traj_id, t.ctx, OUT))
        self._kick(t.instance)

    def _kick(self, i: int) -> None:
        if self.busy_until[i] is None and self.engines[i].has_work:
            self._start(i)

    def _start(self, i: int) -> None:
        limit = self.events[0][0] - self.now_s if self.events else np.inf
        res = self.engines[i].step(max_steps=8, max_duration_s=max(limit, 0.0))
        end = self.now_s + res.duration_s
        self.busy_until[i] = end
        self.pending[i] = res
        self._push(end, "step", str(i))

    def run_until(self, stop_s: float) -> None:
        while self.events and self.events[0][0] <= stop_s:
            time_s, _, kind, ident = heapq.heappop(self.events)
            self.now_s = time_s
            if kind == "admit":
                self._submit(self.trajs[ident])
                continue
            if kind == "env":
                t = self.trajs[ident]
                t.ctx += OBS
                self._submit(t)
                continue
            i = int(ident)
            res = self.pending.pop(i)
            self.busy_until[i] = None
            for f in res.finished:
                t = self.trajs[f.request.traj_id]
                t.done += 1
                t.ctx += OUT
                if t.done == t.turns:
                    t.finished_s = time_s
                    t.phase = TrajPhase.DECODE  # unused once finished
                else:
                    t.phase = TrajPhase.ENV
                    t.env_end_s = time_s + self.env_s
                    self._push(t.env_end_s, "env", t.traj_id)
            self._kick(i)
        self.now_s = max(self.now_s, stop_s) if np.isfinite(stop_s) else self.now_s

    def snapshot(self) -> tuple[TrajectoryProgress, ...]:
        out = []
        for t in self.trajs.values():
            if t.finished_s is not None:
                continue
            phase, generated, env_rest_s = TrajPhase.QUEUED, 0, 0.0
            if t.phase is TrajPhase.ENV:
                phase, env_rest_s = TrajPhase.ENV, max(t.env_end_s - self.now_s, 0.0)
            else:
                eng = self.engines[t.instance]
                seq = eng._by_id.get(t.request_id)  # a private look, for the snapshot only
                step = self.pending.get(t.instance)
                if step is not None and any(
                    f.request.request_id == t.request_id for f in step.finished
                ):  # its last token is in the step running now
                    phase, generated = TrajPhase.DECODE, OUT - 1
                elif seq is not None and seq.decoding:
                    phase, generated = TrajPhase.DECODE, eng.num_generated(t.request_id)
                elif seq is not None and seq in eng._prefilling:
                    phase = TrajPhase.PREFILL
            left = t.turns - t.done  # in env: the turns after the tool call
            out.append(
                TrajectoryProgress(
                    traj_id=t.traj_id,
                    phase=phase,
                    context_tokens=t.ctx + generated,
                    remaining_turns=float(left),
                    turn_output_tokens=generated,
                    env_remaining_s=env_rest_s,
                    group_id=f"g{t.group}",
                )
            )
        return tuple(out)


def _profile() -> RuntimeProfile:
    profile = load_profile("qwen3-8b")
    defaults = profile.workload.model_copy(
        update={
            "prompt_tokens": float(PROMPT),
            "turns_per_trajectory": float(DEFAULT_TURNS),
            "output_tokens_per_turn": float(OUT),
            "observation_tokens_per_turn": float(OBS),
        }
    )
    return profile.model_copy(update={"workload": defaults})


def _group_done_s(run: Run, groups: set[int], after_s: float) -> list[float]:
    """Completion times (after ``after_s``) of ``groups``, sorted."""
    last: dict[int, float] = {}
    for t in run.trajs.values():
        if t.group in groups:
            assert t.finished_s is not None
            last[t.group] = max(last.get(t.group, 0.0), t.finished_s)
    return sorted(v - after_s for v in last.values())


def _trajectories(seed: int, k: int, groups: int, g: int) -> list[Traj]:
    """Random whole turns (1 to 10) per trajectory, one prompt length per group."""
    rng = np.random.default_rng(seed)
    turns = rng.integers(1, 11, groups * g)
    prompts = rng.integers(800, 3000, groups)
    return [
        Traj(f"t{j}", j // g, int(turns[j]), int(prompts[j // g]), j % k) for j in range(groups * g)
    ]


def _started(
    profile: RuntimeProfile, k: int, env_s: float, trajs: list[Traj], g: int, stagger_s: float
) -> Run:
    """A run whose groups are admitted one every ``stagger_s`` seconds (0: all at once)."""
    run = Run(profile, k, env_s)
    for t in trajs:
        run.admit(replace(t), t.group * stagger_s)
    return run


def discrete_case(
    seed: int, k: int, groups: int, g: int, env_s: float, stagger_s: float, warm: bool
) -> dict[str, Any]:
    """One snapshot, once every group is admitted (the groups one every ``stagger_s``):
    cold (just then) or warm (once a third of the groups are done, a third as many fresh
    groups admitted then)."""
    profile = _profile()
    trajs = _trajectories(seed, k, groups, g)
    at_s = (groups - 1) * stagger_s
    if warm:
        horizon = _started(profile, k, env_s, trajs, g, stagger_s)
        horizon.run_until(np.inf)
        at_s = max(at_s, _group_done_s(horizon, set(range(groups)), 0.0)[groups // 3])
    run = _started(profile, k, env_s, trajs, g, stagger_s)
    run.run_until(at_s)
    listed = run.snapshot()
    fresh = max(groups // 3, 1) if warm else 0
    for j in range(fresh * g):
        run.admit(Traj(f"f{j}", groups + j // g, DEFAULT_TURNS, PROMPT, j % k), at_s)
    run.run_until(np.inf)
    open_groups = {int(t.group_id[1:]) for t in listed if t.group_id} | set(
        range(groups, groups + fresh)
    )
    truth = _group_done_s(run, open_groups, at_s)
    stats = TurnStats(
        output_tokens_per_turn=OUT, observation_tokens_per_turn=OBS, env_latency_s=env_s
    )
    base = WorkloadSnapshot(trajectories=listed, not_started=fresh * g, stats=stats)
    config = colocated(k)
    all_s = predict_many(base, [config], profile)[0].completion_s
    rows = []
    for m in sorted({1, len(truth) // 4, len(truth) // 2, 3 * len(truth) // 4, len(truth)} - {0}):
        ask = WorkloadSnapshot.model_validate(
            {**base.model_dump(), "next_batch": {"groups_needed": m, "group_size": g}}
        )
        got_s = predict_many(ask, [config], profile)[0].completion_s
        rows.append(
            {
                "m": m,
                "truth_s": round(truth[m - 1], 2),
                "rel_err": round(got_s / truth[m - 1] - 1, 4),
                # the batch's share of the all-complete time, predicted over true
                "share_err": round((got_s / all_s) / (truth[m - 1] / truth[-1]) - 1, 4),
            }
        )
    return {
        "seed": seed,
        "instances": k,
        "groups": len(truth),
        "group_size": g,
        "env_s": env_s,
        "stagger_s": stagger_s,
        "warm": warm,
        "by_m": rows,
        "all_complete_rel_err": round(all_s / truth[-1] - 1, 4),
    }


def _alone_s(profile: RuntimeProfile, prompt: int, new: F64, out: F64, tool_s: F64) -> float:
    """One trajectory served alone: each turn's prefill, decode at batch 1, then its tool."""
    engine = profile.engine(GPU, TP)
    assert engine is not None
    total_s = float(tool_s.sum())
    ctx = prompt
    for i in range(len(out)):
        fresh = prompt if i == 0 else int(new[i])
        ctx += 0 if i == 0 else fresh
        total_s += engine.prefill.batch_s([fresh], [ctx - fresh])
        total_s += float(engine.decode.step_s(1, ctx + (out[i] - 1) / 2)) * out[i]
        ctx += int(out[i])
    return total_s


def _observed_stats(specs: list[TrajectorySpec]) -> TurnStats:
    """Per-turn means and spreads of the draws, as the simulator's ``turn_stats``."""
    outs = np.concatenate([s.output_tokens for s in specs]).astype(float)
    tools = np.concatenate([s.tool_latency_s for s in specs])
    turns = np.array([s.num_turns for s in specs], float)
    news = np.concatenate([s.new_tokens[1:] for s in specs]).astype(float)
    return TurnStats(
        output_tokens_per_turn=float(outs.mean()),
        observation_tokens_per_turn=float(news.mean()),
        env_latency_s=float(tools.mean()),
        output_tokens_sd=float(outs.std()),
        env_latency_sd_s=float(tools.std()),
        turns_cv=float(turns.std() / turns.mean()),
    )


def spread_case(
    profile: RuntimeProfile, specs: list[TrajectorySpec], groups: int, g: int, draws: int
) -> dict[str, Any]:
    """The mean m-th group completion over ``draws`` batches of ``groups`` groups of ``g``
    (a group's samples share its first prompt), against the predictor's, uncontended."""
    need = groups * g
    times = np.empty((draws, groups, g))
    for d in range(draws):
        for j in range(need):
            spec = specs[(d * need + j) % len(specs)]
            prompt = specs[(d * need + j - j % g) % len(specs)].prompt_tokens
            times[d, j // g, j % g] = _alone_s(
                profile,
                prompt,
                np.asarray(spec.new_tokens, float),
                np.asarray(spec.output_tokens, float),
                np.asarray(spec.tool_latency_s, float),
            )
    truth = np.sort(times.max(axis=2), axis=1).mean(axis=0)
    used = specs[: draws * need] if draws * need <= len(specs) else specs
    stats = _observed_stats(used)
    turns = np.array([s.num_turns for s in used], float)
    prompt = int(np.mean([s.prompt_tokens for s in used]))
    listed = tuple(
        TrajectoryProgress(
            traj_id=f"t{j}",
            phase=TrajPhase.QUEUED,
            context_tokens=prompt,
            remaining_turns=float(turns.mean()),
            group_id=f"g{j // g}",
        )
        for j in range(need)
    )
    config = colocated(64 * need)  # a decode batch of about 1
    rows = []
    for m in sorted({1, groups // 4, groups // 2, 3 * groups // 4, groups} - {0}):
        row: dict[str, Any] = {"m": m, "truth_s": round(float(truth[m - 1]), 1)}
        for name, with_spread in (("rel_err", True), ("rel_err_means", False)):
            work = WorkloadSnapshot(
                trajectories=listed,
                stats=stats
                if with_spread
                else TurnStats(
                    output_tokens_per_turn=stats.output_tokens_per_turn,
                    observation_tokens_per_turn=stats.observation_tokens_per_turn,
                    env_latency_s=stats.env_latency_s,
                ),
                next_batch=NextBatch(groups_needed=m, group_size=g),
            )
            got_s = predict_many(work, [config], profile)[0].completion_s
            row[name] = round(got_s / float(truth[m - 1]) - 1, 4)
        rows.append(row)
    return {"groups": groups, "group_size": g, "draws": draws, "by_m": rows}


def _timeline(
    profile: RuntimeProfile, spec: TrajectorySpec, prompt: int
) -> list[tuple[str, float, int, int]]:
    """One trajectory alone: its phases in order, as (phase, seconds, turn, context)."""
    engine = profile.engine(GPU, TP)
    assert engine is not None
    parts = []
    ctx = prompt
    for i, out in enumerate(spec.output_tokens):
        fresh = prompt if i == 0 else spec.new_tokens[i]
        ctx += 0 if i == 0 else fresh
        parts.append(("prefill", engine.prefill.batch_s([fresh], [ctx - fresh]), i, ctx))
        step_s = float(engine.decode.step_s(1, ctx + (out - 1) / 2))
        parts.append(("decode", step_s * out, i, ctx))
        ctx += out
        if i + 1 < spec.num_turns:
            parts.append(("env", spec.tool_latency_s[i], i, ctx + spec.new_tokens[i + 1]))
    return parts


def _progress_at(
    parts: list[tuple[str, float, int, int]],
    spec: TrajectorySpec,
    at_s: float,
    turns_left: tuple[float, ...],
    mean_env_s: float,
    traj_id: str,
    group_id: str,
) -> tuple[TrajectoryProgress | None, float]:
    """What a coordinator sees of a trajectory ``at_s`` after it began (as the simulator's
    snapshot reports it), and its true remaining time; None once it has finished."""
    elapsed = 0.0
    for phase, duration_s, turn, ctx in parts:
        if at_s < elapsed + duration_s:
            into_s = at_s - elapsed
            rest_s = sum(d for _, d, _, _ in parts) - at_s
            left = turns_left[turn] if turn < len(turns_left) else 1.0
            if phase == "prefill":
                progress = TrajectoryProgress(
                    traj_id=traj_id,
                    phase=TrajPhase.PREFILL,
                    context_tokens=ctx,
                    remaining_turns=left,
                    group_id=group_id,
                )
            elif phase == "decode":
                k = int(spec.output_tokens[turn] * into_s / duration_s)
                progress = TrajectoryProgress(
                    traj_id=traj_id,
                    phase=TrajPhase.DECODE,
                    context_tokens=ctx + k,
                    remaining_turns=left,
                    turn_output_tokens=k,
                    group_id=group_id,
                )
            else:
                after = turns_left[turn + 1] if turn + 1 < len(turns_left) else 1.0
                progress = TrajectoryProgress(
                    traj_id=traj_id,
                    phase=TrajPhase.ENV,
                    context_tokens=ctx,
                    remaining_turns=after,
                    env_remaining_s=max(mean_env_s - into_s, 0.0),
                    group_id=group_id,
                )
            return progress, rest_s
        elapsed += duration_s
    return None, 0.0


def spread_warm_case(
    profile: RuntimeProfile,
    specs: list[TrajectorySpec],
    turns_left: tuple[float, ...],
    stats: TurnStats,
    groups: int,
    g: int,
    draws: int,
) -> dict[str, Any]:
    """Groups begun at uniform times over one mean trajectory's duration, seen then: every
    phase, groups partly done. Per draw, the m-th of the open groups' remaining times
    against the predictor's, uncontended; reported as the mean over draws of each."""
    need = groups * g
    config = colocated(64 * need)
    rng = np.random.default_rng(1)
    span_s = float(
        np.mean(
            [sum(d for _, d, _, _ in _timeline(profile, s, s.prompt_tokens)) for s in specs[:500]]
        )
    )
    shares = np.linspace(0.0, 1.0, 5)[1:]
    truths: dict[float, list[float]] = {q: [] for q in shares}
    preds: dict[float, list[float]] = {q: [] for q in shares}
    all_truth: list[float] = []
    all_pred: list[float] = []
    for d in range(draws):
        listed: list[TrajectoryProgress] = []
        left_s: dict[int, float] = {}
        for gi in range(groups):
            begun_s = span_s * float(rng.uniform())
            for k in range(g):
                j = d * need + gi * g + k
                spec = specs[j % len(specs)]
                prompt = specs[(d * need + gi * g) % len(specs)].prompt_tokens
                parts = _timeline(profile, spec, prompt)
                seen, rest_s = _progress_at(
                    parts,
                    spec,
                    span_s - begun_s,
                    turns_left,
                    stats.env_latency_s,
                    f"t{j}",
                    f"g{gi}",
                )
                if seen is not None:
                    listed.append(seen)
                    left_s[gi] = max(left_s.get(gi, 0.0), rest_s)
        open_s = sorted(left_s.values())
        whole = WorkloadSnapshot(trajectories=tuple(listed), stats=stats)
        all_truth.append(open_s[-1])
        all_pred.append(predict_many(whole, [config], profile)[0].completion_s)
        for q in shares:
            m = max(1, round(q * len(open_s)))
            work = WorkloadSnapshot(
                trajectories=tuple(listed),
                stats=stats,
                next_batch=NextBatch(groups_needed=m, group_size=g),
            )
            truths[q].append(open_s[m - 1])
            preds[q].append(predict_many(work, [config], profile)[0].completion_s)
    rows = [
        {
            "m_share": round(float(q), 2),
            "truth_s": round(float(np.mean(truths[q])), 1),
            "rel_err": round(float(np.mean(preds[q]) / np.mean(truths[q]) - 1), 4),
            "per_draw_mape": round(float(np.mean(np.abs(np.array(preds[q]) / truths[q] - 1))), 4),
        }
        for q in shares
    ]
    all_err = float(np.mean(all_pred) / np.mean(all_truth) - 1)
    return {
        "groups": groups,
        "group_size": g,
        "draws": draws,
        "warm": True,
        "by_m": rows,
        "all_complete_rel_err": round(all_err, 4),
    }


def spread_cases(quick: bool) -> list[dict[str, Any]]:
    scenario, profile = load_scenario_and_profile(SCENARIO)
    inputs = run_inputs(scenario, profile, 0)
    stream = trajectory_stream(
        inputs.trajectory_model, trajectory_rng(0), scenario.rollout.max_context_tokens
    )
    specs = [next(stream) for _ in range(20_480 if quick else 81_920)]
    cases = []
    for groups, g in [(8, 1), (32, 1), (8, 8), (32, 8), (128, 8), (32, 16)]:
        draws = max(len(specs) // (groups * g), 1)
        cases.append(spread_case(profile, specs, groups, g, min(draws, 200)))
    stats = _observed_stats(specs)
    table = turns_left_table(inputs.trajectory_model)
    for groups, g in [(32, 1), (128, 1), (16, 8), (64, 8)]:
        draws = min(max(len(specs) // (groups * g), 1), 10 if quick else 40)
        cases.append(spread_warm_case(profile, specs, table, stats, groups, g, draws))
    return cases


def _mape(errors: list[float]) -> float:
    return round(float(np.mean(np.abs(errors))), 4)


def _max(errors: list[float]) -> float:
    return round(float(np.max(np.abs(errors))), 4)


def main() -> None:
    quick = "--quick" in sys.argv
    cases = []
    grid = [(1, 8, 1), (2, 16, 4), (4, 16, 8), (8, 8, 16)]  # (instances, groups, group size)
    for seed, (k, groups, g) in enumerate(grid[:2] if quick else grid):
        for env_s in (0.3, 2.0) if quick else (0.3, 2.0, 10.0):
            for stagger_s in (0.0, 1.0):
                for warm in (False, True):
                    cases.append(discrete_case(seed, k, groups, g, env_s, stagger_s, warm))
    summary: dict[str, Any] = {"cases": len(cases)}
    for name, keep in (("cold", False), ("warm", True)):
        chosen = [c for c in cases if c["warm"] is keep]
        rows = [(e, c["groups"]) for c in chosen for e in c["by_m"]]
        summary[name] = {
            "next_batch_mape": _mape([e["rel_err"] for e, _ in rows]),
            "next_batch_max": _max([e["rel_err"] for e, _ in rows]),
            "next_batch_mape_half_or_more": _mape(
                [e["rel_err"] for e, g in rows if 2 * e["m"] >= g]
            ),
            "share_mape": _mape([e["share_err"] for e, _ in rows]),
            "all_complete_mape": _mape([c["all_complete_rel_err"] for c in chosen]),
            "all_complete_max": _max([c["all_complete_rel_err"] for c in chosen]),
        }
    spread = spread_cases(quick)
    fresh = [r for c in spread if not c.get("warm") for r in c["by_m"]]
    warm_cases = [c for c in spread if c.get("warm")]
    warm_rows = [r for c in warm_cases for r in c["by_m"]]
    spread_summary = {
        "fresh_mape": _mape([r["rel_err"] for r in fresh]),
        "fresh_max": _max([r["rel_err"] for r in fresh]),
        "fresh_mape_without_spreads": _mape([r["rel_err_means"] for r in fresh]),
        "warm_mape_of_means": _mape([r["rel_err"] for r in warm_rows]),
        "warm_max_of_means": _max([r["rel_err"] for r in warm_rows]),
        "warm_per_draw_mape": round(float(np.mean([r["per_draw_mape"] for r in warm_rows])), 4),
        "warm_all_complete_mape": _mape([c["all_complete_rel_err"] for c in warm_cases]),
    }
    report = {
        "discrete": {"summary": summary, "cases": cases},
        "spread": {"summary": spread_summary, "cases": spread},
    }
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
