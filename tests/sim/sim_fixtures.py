"""Small simulator inputs for the runner, baseline and oracle tests (a plain module).

Everything here is built in Python, without the public traces: a two-node scenario (one
h800 trainer node, one h20 rollout node) with a short duration and a small batch, and a
tiny trajectory model whose lengths are either constant (``constant_model``: every draw
is exactly the given value) or drawn from a handful of observations (``small_model``).
Runs on these inputs take well under a second each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from pearl.core.profile import RuntimeProfile
from pearl.io.documents import load_profile
from pearl.runlog.schema import Record
from pearl.sim.availability import Window
from pearl.sim.baselines import make_policy
from pearl.sim.distributions import EmpiricalTail
from pearl.sim.fleet import Instance
from pearl.sim.metrics import RunMetrics
from pearl.sim.runner import RunInputs, Simulation
from pearl.sim.scenario import Scenario
from pearl.sim.trajectories import TrajectoryModel, fit_trajectory_model

TRAINER_GPU, ROLLOUT_GPU, ELASTIC_GPU = "h800", "h20", "h800"


@cache
def profile() -> RuntimeProfile:
    return load_profile("qwen3-8b")


def scenario_dict(
    *,
    duration_s: float = 900.0,
    batch: int = 16,
    staleness: int = 1,
    rollout_nodes: int = 1,
    elastic: bool = False,
    train_step_s: float | None = 20.0,
    grace_s: float = 30.0,
    queue_delay_median_s: float = 5.0,
    max_return_delay_s: float = 30.0,
    batching: str = "in-order",
    past_bound: str = "interrupt",
    group_size: int = 1,
) -> dict[str, Any]:
    """A small scenario as a document (also written as YAML by the CLI test). In-order
    batches unless told: the tests of policies were written for them; the rollout's own
    rules are tested under every setting (``busy_run``'s ``rules``)."""
    el: dict[str, Any] = {"source": "none"}
    if elastic:
        # Synthetic is the only source that needs no trace; the tests pass their own
        # windows in RunInputs.windows, so these settings only make the scenario valid.
        el = {
            "source": "synthetic",
            "synthetic": {
                "gpu_type": ELASTIC_GPU,
                "arrivals_per_h": 4.0,
                "lifetime_median_s": 400.0,
                "lifetime_sigma": 0.5,
                "max_gpus": 16,
            },
        }
    el.update(queue_delay_median_s=queue_delay_median_s, queue_delay_sigma=0.0, grace_s=grace_s)
    return {
        "schema_version": 1,
        "name": "tiny",
        "profile": "qwen3-8b",
        "duration_s": duration_s,
        "seeds": 1,
        "cluster": {
            "trainer": {"nodes": 1, "gpu_type": TRAINER_GPU},
            "rollout": {"nodes": rollout_nodes, "gpu_type": ROLLOUT_GPU},
        },
        "elastic": el,
        "rollout": {
            "batch_trajectories": batch,
            "staleness_versions": staleness,
            "max_context_tokens": 32768,
            "batching": batching,
            "past_bound": past_bound,
            "group_size": group_size,
        },
        "training": {"train_step_s": train_step_s},
        "policy": {
            "borrowing": {"max_return_delay_s": max_return_delay_s},
            "elastic": {"gpu_type": ELASTIC_GPU, "gpus_per_allocation": 8, "max_allocations": 2},
        },
    }


def scenario(**kw: Any) -> Scenario:
    return Scenario.model_validate(scenario_dict(**kw))


def constant(value: float) -> EmpiricalTail:
    """A distribution every draw of which is exactly ``value`` (no tail mass)."""
    return EmpiricalTail(
        body=(float(value),),
        threshold=float(value),
        tail_fraction=0.0,
        log_mu=math.log(value),
        log_sigma=1.0,
        num_observations=1,
        cap=4.0 * float(value),
    )


def constant_model(
    *,
    turns: int = 1,
    prompt: int = 100,
    observation: int = 20,
    output: int = 10,
    tool_s: float = 0.5,
) -> TrajectoryModel:
    """Every trajectory the same: ``turns`` turns, these lengths and this tool latency."""
    return TrajectoryModel(
        turns_observed=(turns,),
        prompt_tokens=constant(prompt),
        observation_tokens=constant(observation),
        output_tokens=constant(output),
        tool_latency_s=constant(tool_s),
    )


def small_model() -> TrajectoryModel:
    """A few turns of short prompts and outputs, small tool latencies (varied per draw)."""
    return fit_trajectory_model(
        turns_per_session=[1, 2, 3, 2],
        prompt_tokens=[200, 300, 400, 500],
        observation_tokens=[20, 40, 60],
        output_tokens=[30, 50, 80, 120],
        tool_latency_s=[0.2, 0.5, 1.0],
    )


# Elastic windows that open early and end mid-run (preemption of whatever runs on them);
# the first is two nodes, the second one node that closes before the run ends too.
PREEMPTED_WINDOWS: tuple[Window, ...] = (
    Window(0.0, 420.0, 16, ELASTIC_GPU),
    Window(100.0, 650.0, 8, ELASTIC_GPU),
)


def inputs(
    sc: Scenario | None = None,
    *,
    model: TrajectoryModel | None = None,
    windows: Sequence[Window] = (),
    seed: int = 0,
    decision_interval_s: float = 60.0,
) -> RunInputs:
    return RunInputs(
        scenario=sc if sc is not None else scenario(),
        profile=profile(),
        trajectory_model=model if model is not None else small_model(),
        windows=tuple(windows),
        seed=seed,
        decision_interval_s=decision_interval_s,
    )


@dataclass
class Run:
    sim: Simulation  # its state at the end of the run
    metrics: RunMetrics
    records: list[Record]
    generated_tokens: int  # every token any engine step generated (counted at the step)


def run(run_inputs: RunInputs, policy: str = "pearl") -> Run:
    """One run, with its log and a count of the tokens the engines generated."""
    sc = run_inputs.scenario
    records: list[Record] = []
    sim = Simulation(
        run_inputs, make_policy(policy, sc.policy, sc.cluster.trainer.nodes), records.append
    )
    generated = [0]
    start_step = sim.fleet.start_step

    def counting_start_step(inst: Instance, now_s: float, horizon_s: float) -> float | None:
        end_s = start_step(inst, now_s, horizon_s)
        if end_s is not None and inst.result is not None:
            generated[0] += inst.result.num_generated_tokens
        return end_s

    sim.fleet.start_step = counting_start_step  # type: ignore[method-assign]
    metrics = sim.run()
    return Run(sim, metrics, records, generated[0])


def busy_model() -> TrajectoryModel:
    """Longer turns: enough work that pearl lends the trainer and requests elastic GPUs."""
    return fit_trajectory_model(
        turns_per_session=[2, 3, 4],
        prompt_tokens=[500, 1000, 2000, 4000],
        observation_tokens=[100, 300, 600],
        output_tokens=[300, 600, 1000, 1500],
        tool_latency_s=[0.5, 1.0, 2.0],
    )


# Rollout rules the busy runs are repeated under: (batching, past_bound, group_size).
IN_ORDER = ("in-order", "interrupt", 1)
RULES = [
    IN_ORDER,
    ("first-completed", "interrupt", 4),
    ("first-completed", "restart", 1),
    ("first-completed", "drop", 4),
]


def busy_inputs(seed: int = 0, rules: tuple[str, str, int] = IN_ORDER) -> RunInputs:
    """B = 256 on one rollout node, elastic windows that end mid-run (preemption)."""
    batching, past_bound, group_size = rules
    sc = scenario(
        elastic=True,
        batch=256,
        train_step_s=10.0,
        batching=batching,
        past_bound=past_bound,
        group_size=group_size,
    )
    return inputs(sc, model=busy_model(), windows=PREEMPTED_WINDOWS, seed=seed)


@cache
def busy_run(policy: str, seed: int = 0, rules: tuple[str, str, int] = IN_ORDER) -> Run:
    """``run(busy_inputs(seed, rules), policy)``, shared by the test modules (read-only)."""
    return run(busy_inputs(seed, rules), policy)


def of_type(records: Sequence[Record], type_: str) -> list[Any]:
    return [r for r in records if r.type == type_]
