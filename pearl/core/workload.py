"""A snapshot of the unfinished rollout batch, as the predictor sees it.

Each trajectory is a multi-turn episode: a turn is a prefill (the tokens appended since
the previous turn, or the whole context when its prefix is no longer cached), a decode
of the turn's output, then an environment (tool) step, except after the last turn.

Invariants: counts and times are non-negative; trajectory ids are unique; ``arrays()``
returns one entry per unfinished trajectory (``not_started`` ones included) in the
order of ``trajectories`` followed by the not-started ones. With ``next_batch`` set, every
trajectory has a ``group_id``, no group lists more than ``group_size`` trajectories and
``not_started`` is a whole number of groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Annotated

import numpy as np
from numpy.typing import NDArray
from pydantic import Field, model_validator

from pearl.core.limits import (
    MAX_TOKENS,
    MAX_TRAJECTORIES,
    MAX_TURNS,
    GroupSize,
    Id,
    NonNegFloat,
    NonNegInt,
    Seconds,
    Tokens,
    TrajectoryCount,
    Turns,
)
from pearl.core.profile import WorkloadDefaults
from pearl.core.state import Frozen


class TrajPhase(StrEnum):
    QUEUED = "queued"  # waiting for its next turn's prefill
    PREFILL = "prefill"  # prefill of the current turn running
    DECODE = "decode"  # generating the current turn's output
    ENV = "env"  # waiting on the environment (tool call)


PHASE_CODE = {p: i for i, p in enumerate(TrajPhase)}  # ``TrajectoryArrays.phase`` values


class TrajectoryProgress(Frozen):
    traj_id: Id
    phase: TrajPhase
    context_tokens: Tokens = Field(description="Tokens of context so far.")
    remaining_turns: Turns = Field(
        description="Expected turns still to start or finish, the current one included "
        "(in env: the turns after the tool call)."
    )
    turn_output_tokens: Tokens = Field(0, description="Tokens generated in the current turn.")
    env_remaining_s: Seconds = Field(0.0, description="Expected rest of the current env step.")
    group_id: Id | None = Field(
        None,
        description="The GRPO group (prompt) the trajectory samples; required when the "
        "snapshot asks for a next batch (WorkloadSnapshot.next_batch).",
    )
    fresh: bool = Field(
        False,
        description="Queued for its first prefill with nothing of it cached: that prefill "
        "computes the whole context (not-started trajectories are fresh).",
    )


class TurnStats(Frozen):
    """Observed per-turn means of the run; they override the profile's defaults.

    The standard deviations, when given, let the predictor estimate the batch's
    straggler (the slowest of many trajectories, not the mean one; ``docs/predictor.md``).
    """

    output_tokens_per_turn: Annotated[float, Field(gt=0, le=MAX_TOKENS)]
    observation_tokens_per_turn: NonNegFloat
    env_latency_s: Seconds
    output_tokens_sd: NonNegFloat | None = Field(None, description="Per-turn output spread.")
    env_latency_sd_s: NonNegFloat | None = Field(None, description="Per-turn env latency spread.")
    turns_cv: NonNegFloat | None = Field(
        None,
        description="Relative spread (sd / mean) of turns per trajectory; the predictor "
        "applies it to the turns left.",
    )
    turns_observed: NonNegInt | None = Field(
        None,
        description="The completed turns the output mean is of. Given, the mean is "
        "weighed against the profile's by the turns still running "
        "(WorkloadSnapshot.turn_stats).",
    )

    @property
    def has_spread(self) -> bool:
        return None not in (self.output_tokens_sd, self.env_latency_sd_s, self.turns_cv)


class NextBatch(Frozen):
    """What the trainer waits for under ``first-completed`` batching: whole groups.

    A group is complete when all its trajectories have finished; the trainer's next batch
    is the first ``groups_needed`` groups to complete (``docs/predictor.md``).
    """

    groups_needed: TrajectoryCount = Field(
        description="Complete groups the trainer still waits for (0: the batch is ready)."
    )
    group_size: GroupSize = Field(description="Trajectories per group (samples per prompt).")
    not_started_after_s: Seconds = Field(
        0.0,
        description="The not-started groups begin this long from now (admitted at the end "
        "of the update that runs); when the batch needs them, it completes that much later.",
    )
    groups_per_batch: TrajectoryCount = Field(
        0,
        description="Groups of a whole batch (B / group_size): the next update admits this "
        "many more, and a lookahead asks for the batch after the next (0: no lookahead).",
    )


class WorkloadSnapshot(Frozen):
    trajectories: tuple[TrajectoryProgress, ...] = Field((), max_length=MAX_TRAJECTORIES)
    not_started: TrajectoryCount = Field(
        0,
        description="Trajectories admitted but not begun yet (with next_batch: whole "
        "groups of group_size), each of not_started_prompt_tokens and not_started_turns.",
    )
    stats: TurnStats | None = Field(None, description="Observed turn statistics, if any.")
    not_started_prompt_tokens: Annotated[float, Field(gt=0, le=MAX_TOKENS)] | None = Field(
        None,
        description="Expected prompt tokens of a trajectory not begun yet (the finished "
        "trajectories' mean); None: the profile's default.",
    )
    not_started_turns: Annotated[float, Field(ge=1, le=MAX_TURNS)] | None = Field(
        None,
        description="Expected turns of a trajectory not begun yet (the run's turn-count "
        "distribution); None: the profile's default.",
    )
    next_batch: NextBatch | None = Field(
        None,
        description="None: predict until every unfinished trajectory completes (in-order "
        "batches). Set: until groups_needed more groups complete, the groups being those "
        "of trajectories (by group_id; only unfinished members are listed, a group "
        "completes when its listed members do) and not_started // group_size groups not "
        "begun yet.",
    )

    @model_validator(mode="after")
    def _unique_ids(self) -> WorkloadSnapshot:
        ids = [t.traj_id for t in self.trajectories]
        if len(set(ids)) != len(ids):
            raise ValueError("trajectories: duplicate traj_id")
        if self.num_unfinished > MAX_TRAJECTORIES:
            raise ValueError(
                f"not_started: {self.num_unfinished} unfinished trajectories in all, more "
                f"than the {MAX_TRAJECTORIES} in flight pearl is built for"
            )
        return self

    @model_validator(mode="after")
    def _whole_groups(self) -> WorkloadSnapshot:
        if self.next_batch is None:
            return self
        size = self.next_batch.group_size
        members: dict[str, int] = {}
        for t in self.trajectories:
            if t.group_id is None:
                raise ValueError(f"next_batch: trajectory {t.traj_id} has no group_id")
            members[t.group_id] = members.get(t.group_id, 0) + 1
            if members[t.group_id] > size:
                raise ValueError(
                    f"next_batch: group {t.group_id} lists more than group_size {size} trajectories"
                )
        if self.not_started % size:
            raise ValueError(
                f"next_batch: not_started {self.not_started} is not a multiple of group_size {size}"
            )
        return self

    @property
    def num_unfinished(self) -> int:
        return len(self.trajectories) + self.not_started

    def lookahead(self) -> WorkloadSnapshot | None:
        """The batch after the next as well: the groups the next update admits (a whole
        batch, not started, each from the defaults) and the groups of both batches to
        complete; None without a ``NextBatch`` that knows a batch's groups. The admitted
        groups are taken to start with the not-started ones (no later), so the lookahead
        is for comparing GPU pools, not for its absolute time."""
        nb = self.next_batch
        if nb is None or nb.groups_per_batch == 0:
            return None
        more = nb.groups_per_batch * nb.group_size
        if self.num_unfinished + more > MAX_TRAJECTORIES:
            return None
        return self.model_copy(
            update={
                "not_started": self.not_started + more,
                "next_batch": nb.model_copy(
                    update={"groups_needed": nb.groups_needed + nb.groups_per_batch}
                ),
            }
        )

    def turn_stats(self, defaults: WorkloadDefaults) -> TurnStats:
        """The per-turn statistics to predict with: the observed ones, the profile's
        defaults before any.

        The observed output mean is of the turns that have ended, and early on those are
        the short ones: a turn that has run a few seconds ended only if its output is
        short, while the long ones still run. So it is weighed against the defaults' by
        counts, the ``n`` turns observed against the ``k`` still running (the started
        trajectories not in a tool call), each of those counted at the default:
        ``(n * observed + k * default) / (n + k)``. Once the run has observed many more
        turns than run at once, it is the observed mean. (On a batch of 2,048
        trajectories whose engines had served for 3 s, the 32 turns ended had 16 output
        tokens on average against 328 in the workload: the prediction had the batch
        complete 12 s later, and the lent GPUs went back a minute before it did;
        ``docs/predictor.md``, "Observed statistics".)"""
        stats = self.stats
        if stats is None:
            return TurnStats(
                output_tokens_per_turn=defaults.output_tokens_per_turn,
                observation_tokens_per_turn=defaults.observation_tokens_per_turn,
                env_latency_s=defaults.env_latency_s,
            )
        n = stats.turns_observed
        if n is None:
            return stats
        running = int(np.count_nonzero(self._arrays_of_started.phase != PHASE_CODE[TrajPhase.ENV]))
        if running == 0:
            return stats
        observed, prior = stats.output_tokens_per_turn, defaults.output_tokens_per_turn
        output = (n * observed + running * prior) / (n + running)
        return stats.model_copy(update={"output_tokens_per_turn": output})

    @cached_property
    def _arrays_of_started(self) -> TrajectoryArrays:
        n = len(self.trajectories)
        phase = np.empty(n, dtype=np.int8)
        ctx = np.empty(n)
        turns = np.empty(n)
        out = np.empty(n)
        env = np.empty(n)
        fresh = np.empty(n, dtype=bool)
        for i, t in enumerate(self.trajectories):
            phase[i] = PHASE_CODE[t.phase]
            ctx[i] = t.context_tokens
            turns[i] = t.remaining_turns
            out[i] = t.turn_output_tokens
            env[i] = t.env_remaining_s
            fresh[i] = t.fresh
        return TrajectoryArrays(phase, ctx, turns, out, env, fresh)

    def arrays(self, defaults: WorkloadDefaults) -> TrajectoryArrays:
        """Column arrays of all unfinished trajectories (not-started ones from defaults)."""
        started = self._arrays_of_started
        k = self.not_started
        if k == 0:
            return started
        prompt_tokens = self.not_started_prompt_tokens or defaults.prompt_tokens
        turns = self.not_started_turns or defaults.turns_per_trajectory
        return TrajectoryArrays(
            phase=np.concatenate([started.phase, np.zeros(k, dtype=np.int8)]),
            context_tokens=np.concatenate([started.context_tokens, np.full(k, prompt_tokens)]),
            remaining_turns=np.concatenate([started.remaining_turns, np.full(k, turns)]),
            turn_output_tokens=np.concatenate([started.turn_output_tokens, np.zeros(k)]),
            env_remaining_s=np.concatenate([started.env_remaining_s, np.zeros(k)]),
            fresh=np.concatenate([started.fresh, np.ones(k, dtype=bool)]),
        )


@dataclass(frozen=True)
class TrajectoryArrays:
    """Columns of the unfinished trajectories; ``phase`` holds ``PHASE_CODE`` values."""

    phase: NDArray[np.int8]
    context_tokens: NDArray[np.float64]
    remaining_turns: NDArray[np.float64]
    turn_output_tokens: NDArray[np.float64]
    env_remaining_s: NDArray[np.float64]
    fresh: NDArray[np.bool_]  # nothing cached: the next prefill computes the whole context
