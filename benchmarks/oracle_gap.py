"""Where a policy's run stands against the oracle, and why (docs/baselines.md, "oracle").

For each shipped scenario and seed: the oracle (``pearl.sim.oracle``), its relaxation
replayed (``pearl.sim.oracle_replay``: every trajectory at its own time from admission)
with the GPU part of every trajectory's time taken 1, 1.15, 1.5, 2 and 3 times (how far
the bound moves if the GPUs slowed every trajectory down so much), an estimate of the
slowdown the GPUs force (``fluid_slowdown``), and one policy's run:
its trajectories, updates, the time its finished trajectories spent outside their tool
calls against the oracle's lower bound of that time, and what its engines did (decode
step time and batch per generated token, steps that also ran prefill chunks, prefill
tokens computed against the prompts and observations of the trajectories started).

    .venv/bin/python benchmarks/oracle_gap.py [--seeds 0 1 2] [--duration-s 1800]
"""

from __future__ import annotations

import argparse
from itertools import islice
from pathlib import Path

import numpy as np

from pearl.io.scenarios import load_scenario_and_profile
from pearl.io.simulation import run_inputs
from pearl.rollout.ledger import TrajState
from pearl.sim.baselines import make_policy
from pearl.sim.fleet import Instance
from pearl.sim.oracle import run_engines, run_oracle_bound
from pearl.sim.oracle_costs import CostModel
from pearl.sim.oracle_replay import replay_run
from pearl.sim.runner import RunInputs, Simulation
from pearl.sim.trajectories import TrajectorySpec

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
FACTORS = (1.0, 1.15, 1.5, 2.0, 3.0)


def engine_figures(inputs: RunInputs, policy: str) -> tuple[Simulation, dict[str, float]]:
    """The run, and per generated token its decode step and batch, from every engine call."""
    sc = inputs.scenario
    sim = Simulation(inputs, make_policy(policy, sc.policy, sc.cluster.trainer.nodes))
    calls: list[tuple[float, int, int, int, int]] = []  # duration, steps, batch, prefill, tp
    start_step = sim.fleet.start_step

    def recording(inst: Instance, now_s: float, horizon_s: float) -> float | None:
        end_s = start_step(inst, now_s, horizon_s)
        r = inst.result
        if end_s is not None and r is not None and r.num_steps:
            calls.append(
                (r.duration_s, r.num_steps, r.num_decode_seqs, r.num_prefill_tokens, inst.tp)
            )
        return end_s

    sim.fleet.start_step = recording  # type: ignore[method-assign]
    sim.run()
    d, n, b, p, tp = (np.array(c, dtype=float) for c in zip(*calls, strict=True))
    tokens = b * n
    mixed = p > 0
    by_tp = {int(t): float(np.sum(tokens[tp == t]) / np.sum(tokens)) for t in np.unique(tp)}
    return sim, {
        **{f"tp {t}": share for t, share in by_tp.items()},
        "decode_step_ms": 1e3 * float(np.sum(d / n * tokens) / np.sum(tokens)),
        "decode_batch": float(np.sum(b * tokens) / np.sum(tokens)),
        "mixed_token_share": float(np.sum(tokens[mixed]) / np.sum(tokens)),
        "mixed_step_ms": 1e3 * float(np.sum(d[mixed] * b[mixed]) / max(np.sum(tokens[mixed]), 1)),
        "prefill_tokens": float(np.sum(p)),
    }


def first_specs(inputs: RunInputs, n: int) -> list[TrajectorySpec]:
    """The run's first ``n`` trajectories, as its rollout draws them."""
    return list(islice(inputs.stream(), n))


def trajectory_figures(inputs: RunInputs, sim: Simulation) -> dict[str, float]:
    """Of the finished trajectories never restarted: mean seconds from admission to
    finish outside tool calls, against the oracle's own time less the tools."""
    sc = inputs.scenario
    started = sim.rollout.num_started
    specs = first_specs(inputs, started)
    done = [
        r
        for r in sim.rollout.ledger.trajectories.values()
        if r.restarts == 0 and r.state in (TrajState.FINISHED, TrajState.CONSUMED)
    ]
    chosen = [specs[r.index] for r in done]
    tool_s = np.array([sum(s.tool_latency_s) for s in chosen])
    wall_s = np.array([(r.finished_s or 0.0) - r.admitted_s for r in done])
    own_s = CostModel(run_engines(sc, inputs.profile, inputs.windows)).costs(chosen).own_s
    needed = sum(s.prompt_tokens + sum(s.new_tokens) for s in specs)
    return {
        "outside_tools_s": float(np.mean(wall_s - tool_s)),
        "own_outside_tools_s": float(np.mean(own_s - tool_s)),
        "tools_s": float(np.mean(tool_s)),
        "prefill_needed_tokens": float(needed),
    }


def fluid_slowdown(inputs: RunInputs, accepted: int, gpu_s: float) -> tuple[float, float, float]:
    """An estimate, not a bound: the decode of the first ``accepted`` trajectories spread
    evenly over ``gpu_s`` GPU-seconds, all at one engine kind and batch (their mean context
    each, prefill left out). The least step time at which some engine and batch serve
    every token, over the least step of one sequence; the GPU-seconds that takes; and the
    work of the trajectories at their cheapest (``oracle_costs``), prefill included."""
    sc = inputs.scenario
    specs = first_specs(inputs, accepted)
    tokens = ctx_tokens = 0.0
    for s in specs:
        ctx = s.prompt_tokens
        for new, out in zip(s.new_tokens, s.output_tokens, strict=True):
            ctx += new
            tokens += out
            ctx_tokens += out * (ctx + (out - 1) / 2.0)
            ctx += out
    mean_ctx = ctx_tokens / tokens
    engines = run_engines(sc, inputs.profile, inputs.windows)
    work_gpu_s = float(np.sum(CostModel(engines).costs(specs).work_gpu_s))
    alone_s = min(float(e.decode.step_s(1, mean_ctx)) for e in engines)
    best = (np.inf, np.inf)
    for e in engines:
        m = np.arange(1, e.max_num_seqs + 1)
        step_s = e.decode.step_s(m, m * mean_ctx)
        need_gpu_s = tokens * e.tp * step_s / m
        ok = need_gpu_s <= gpu_s
        if ok.any():
            k = int(np.argmin(np.where(ok, step_s, np.inf)))
            best = min(best, (float(step_s[k]) / alone_s, float(need_gpu_s[k])))
    return (*best, work_gpu_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", nargs="+", default=["qwen3-8b", "qwen3-30b-a3b"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--duration-s", type=float, default=None)
    p.add_argument("--policy", default="pearl")
    args = p.parse_args()
    for name in args.scenarios:
        sc, prof = load_scenario_and_profile(SCENARIOS / f"{name}.yaml")
        if args.duration_s is not None:
            sc = sc.model_copy(update={"duration_s": args.duration_s})
        hours = sc.duration_s / 3600.0
        for seed in args.seeds:
            inputs = run_inputs(sc, prof, seed)
            bound = run_oracle_bound(inputs)
            rep = {f: replay_run(inputs, f) for f in FACTORS}
            sim, eng = engine_figures(inputs, args.policy)
            traj = trajectory_figures(inputs, sim)
            slowdown, fluid_gpu_s, work_gpu_s = fluid_slowdown(
                inputs, bound.trajectories, bound.capacity_gpu_s
            )
            run_tph = sim.rollout.ledger.num_accepted / hours
            print(f"## {name} seed {seed} ({sc.duration_s:.0f} s)")
            print(
                f"oracle {bound.trajectories / hours:,.0f} traj/h, {bound.max_updates} updates;"
                f" {args.policy} {run_tph:,.0f} traj/h ({run_tph * hours / bound.trajectories:.3f}"
                f" of it), {sim.train_steps} updates"
            )
            cells = [f"{f:g}: {r.trajectories / hours:,.0f} ({r.updates})" for f, r in rep.items()]
            print("replayed, GPU part x " + ", ".join(cells))
            print(
                f"fluid estimate: the decode of the oracle's {bound.trajectories} trajectories "
                f"on {bound.capacity_gpu_s:,.0f} GPU-s at one engine kind and batch: step "
                f"{slowdown:.2f}x that of one sequence ({fluid_gpu_s:,.0f} GPU-s); their work "
                f"at the cheapest configuration {work_gpu_s:,.0f} GPU-s"
            )
            print(
                f"{args.policy}'s finished trajectories (never restarted): "
                f"{traj['outside_tools_s']:.1f} s outside tools, the oracle's bound of that "
                f"{traj['own_outside_tools_s']:.1f} s; tools {traj['tools_s']:.1f} s"
            )
            print(
                f"engines: decode step {eng['decode_step_ms']:.1f} ms and batch "
                f"{eng['decode_batch']:.1f} per token; {100 * eng['mixed_token_share']:.1f}% of "
                f"tokens in steps with prefill ({eng['mixed_step_ms']:.0f} ms); prefill "
                f"{eng['prefill_tokens'] / 1e6:.1f} M tokens computed, "
                f"{traj['prefill_needed_tokens'] / 1e6:.1f} M in the prompts and observations "
                f"of the trajectories started; generated tokens by instance tp: "
                + ", ".join(f"{k} {v:.2f}" for k, v in eng.items() if k.startswith("tp "))
            )


if __name__ == "__main__":
    main()
