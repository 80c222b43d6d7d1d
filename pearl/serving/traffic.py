"""The workload's mean shape as a router sees it in its own traffic.

The least-loaded rule weighs each instance's load by its busy time per turn of the
workload's mean shape (``routing.turn_work_s``). The simulator's fleet has the workload's
means from its trajectory model; an HTTP router has only the turns it routes. Each turn
tells it the prompt it sends and, for a returning trajectory, the prefix it believes
cached (its *home*'s), and the turn's output when it returns:

- a trajectory's first turn (no home yet): its prompt, ``prompt_tokens``;
- a later turn: the tokens beyond the previous turn's context, ``observation_tokens``
  (what the environment appended);
- every finished turn: its output tokens;
- turns per trajectory: the turns routed over the trajectories begun (the running ones
  count with the turns they have had so far, so it is low while most are young).

Until a quantity has ``MIN_SAMPLES`` observations its prior stands (the profile's
``WorkloadDefaults``); the tool latency is never observed here (the router does not see
the environment) and stays the prior's. Pure: the router calls it, nothing here reads a
clock or does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from pearl.core.profile import WorkloadDefaults

MIN_SAMPLES = 16


@dataclass
class _Mean:
    total: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1

    def or_prior(self, prior: float) -> float:
        return self.total / self.count if self.count >= MIN_SAMPLES else prior


class TrafficMeans:
    """Running means of the turns a router routes (the module docstring)."""

    def __init__(self) -> None:
        self.prompts, self.observations, self.outputs = _Mean(), _Mean(), _Mean()
        self.trajectories = 0  # first turns routed
        self.turns = 0  # turns routed

    def turn_routed(self, prompt_tokens: int, previous_context_tokens: int | None) -> None:
        """A turn of ``prompt_tokens`` goes out; ``previous_context_tokens``: its
        trajectory's context after the previous turn (None: its first turn)."""
        self.turns += 1
        if previous_context_tokens is None:
            self.trajectories += 1
            self.prompts.add(prompt_tokens)
        else:
            self.observations.add(max(0, prompt_tokens - previous_context_tokens))

    def turn_finished(self, output_tokens: int) -> None:
        self.outputs.add(output_tokens)

    def workload(self, prior: WorkloadDefaults) -> WorkloadDefaults:
        """The means observed, each the prior's until it has ``MIN_SAMPLES`` turns."""
        turns = prior.turns_per_trajectory
        if self.trajectories >= MIN_SAMPLES:
            turns = max(1.0, self.turns / self.trajectories)
        return WorkloadDefaults(
            prompt_tokens=max(1.0, self.prompts.or_prior(prior.prompt_tokens)),
            output_tokens_per_turn=max(1.0, self.outputs.or_prior(prior.output_tokens_per_turn)),
            observation_tokens_per_turn=self.observations.or_prior(
                prior.observation_tokens_per_turn
            ),
            env_latency_s=prior.env_latency_s,
            turns_per_trajectory=turns,
        )
