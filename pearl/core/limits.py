"""The upper bounds of pearl's inputs, sized for the largest real deployment.

Every number pearl reads is finite (``Frozen`` refuses ``NaN`` and infinities) and every
count, size and duration has an upper bound here, so that no single input (a state with
a billion not-started trajectories, a grant of 10^12 GPUs, a run of 10^300 seconds) can
make pearl allocate or loop without bound. The bounds are far above any real run and far
below what would exhaust a machine; ``docs/limits.md`` lists them with their reasons.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

MAX_GPUS = 100_000  # GPUs in one state, one grant, one cluster section
MAX_GPUS_PER_NODE = 64  # the densest node (8 and 16 are common; 64 leaves room)
MAX_NODES = MAX_GPUS  # a node has at least one GPU
MAX_ALLOCATIONS = 100_000  # allocations a state tracks (ended ones are pruned)
MAX_TRAJECTORIES = 1_000_000  # trajectories in flight, in a batch, not started
MAX_GROUP_SIZE = 1_024  # samples per prompt (GRPO uses 4-64)
MAX_TOKENS = 16_000_000  # tokens of one context (the longest models: ~1M-10M)
MAX_TURNS = 100_000  # turns of one trajectory
MAX_SECONDS = 366 * 86_400  # a time in a run, or a duration: a year (runs last days)
MAX_SEEDS = 1_000  # simulator runs per policy
MAX_SWEEP_POINTS = 10_000  # grid points of one ``pearl sweep`` (each runs every policy and seed)
MAX_QUANTITY = 1e15  # any other non-negative number (rates, costs, sizes, versions)
MAX_ID_CHARS = 256  # an id or a name (Slurm job ids, host names, GPU ids)

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
Seconds = Annotated[float, Field(ge=0.0, le=MAX_SECONDS)]
SecondsOrNever = Annotated[float, Field(ge=0.0, allow_inf_nan=True)]  # inf: never (no NaN)
PositiveSeconds = Annotated[float, Field(gt=0.0, le=MAX_SECONDS)]
GpuCount = Annotated[int, Field(ge=0, le=MAX_GPUS)]
PositiveGpuCount = Annotated[int, Field(ge=1, le=MAX_GPUS)]
NodeCount = Annotated[int, Field(ge=0, le=MAX_NODES)]
TrajectoryCount = Annotated[int, Field(ge=0, le=MAX_TRAJECTORIES)]
PositiveTrajectoryCount = Annotated[int, Field(ge=1, le=MAX_TRAJECTORIES)]
GroupSize = Annotated[int, Field(ge=1, le=MAX_GROUP_SIZE)]
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
PositiveTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
Turns = Annotated[float, Field(ge=0.0, le=MAX_TURNS)]
NonNegFloat = Annotated[float, Field(ge=0.0, le=MAX_QUANTITY)]
PositiveFloat = Annotated[float, Field(gt=0.0, le=MAX_QUANTITY)]
NonNegInt = Annotated[int, Field(ge=0, le=int(MAX_QUANTITY))]
PositiveInt = Annotated[int, Field(ge=1, le=int(MAX_QUANTITY))]
