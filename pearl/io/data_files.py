"""pearl's data files: workload samples and availability windows (JSON, validated at load).

pearl ships one file of each in ``pearl/data/`` (package data, so an installed wheel has
them), derived from the public traces by ``benchmarks/derive_data.py``; a scenario reads
them by default and can name any other file in the same format (``docs/simulator.md``,
"Data files"). Every problem is an ``InputError`` naming the file and the field.

- **Workload samples** (``format: pearl.workload_samples``): for each trajectory component
  (turns per trajectory, prompt tokens, observation tokens per turn, output tokens per
  turn, tool latency in seconds) the observations as runs: ``values[i]`` observed
  ``counts[i]`` times, in file order. The simulator resamples them (``pearl.sim.
  distributions``); only the turns are drawn by index, so their order decides which draw
  a seed makes (the distribution does not depend on it).
- **Availability windows** (``format: pearl.availability_windows``): blocks of
  ``num_gpus`` GPUs (whole nodes) that another tenant leaves idle from ``start_s`` to
  ``end_s``, seconds from the file's time origin. A scenario drops windows shorter than its
  ``min_duration_s``; the shipped file keeps every window, so that rule is the scenario's.

Both carry ``sources`` (repository, commit, path, licence) and the command that regenerates
them; the models are strict (unknown fields rejected, numbers finite, sizes bounded).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import Field, model_validator

from pearl.core.state import Frozen
from pearl.io.documents import InputError, parse, read_document
from pearl.sim.availability import GPUS_PER_NODE, Window

WORKLOAD_FORMAT = "pearl.workload_samples"
WINDOWS_FORMAT = "pearl.availability_windows"
SHIPPED_WORKLOAD = "agentic_workload.json"
SHIPPED_WINDOWS = "helios_windows.json"
# Bounds that keep one file from asking for unbounded memory or time.
MAX_RUNS = 1_000_000  # distinct (value, count) runs per component
MAX_OBSERVATIONS = 10_000_000  # observations per component, all runs expanded
MAX_WINDOWS = 1_000_000

# Components in file order, with the keyword of ``pearl.sim.trajectories.fit_trajectory_model``.
COMPONENTS = {
    "turns_per_trajectory": "turns_per_session",
    "prompt_tokens": "prompt_tokens",
    "observation_tokens": "observation_tokens",
    "output_tokens": "output_tokens",
    "tool_latency_s": "tool_latency_s",
}
INTEGER_COMPONENTS = tuple(c for c in COMPONENTS if c != "tool_latency_s")

Text = Annotated[str, Field(min_length=1)]
Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1, le=MAX_OBSERVATIONS)]


class Source(Frozen):
    repository: Text = Field(description="Where the raw data is published (GitHub owner/name).")
    commit: Text = Field(description="Commit of the repository the data was read at.")
    path: Text = Field(description="Path of the raw file in that repository.")
    licence: Text = Field(description="Licence of the raw data (SPDX identifier).")
    used_for: Text = Field(description="What of this file went into the derived data.")


class Samples(Frozen):
    """Observations of one component: ``values[i]`` seen ``counts[i]`` times, in order."""

    values: list[Positive] = Field(min_length=1, max_length=MAX_RUNS)
    counts: list[Count] = Field(min_length=1, max_length=MAX_RUNS)

    @model_validator(mode="after")
    def _aligned(self) -> Samples:
        if len(self.values) != len(self.counts):
            raise ValueError(
                f"counts: {len(self.counts)} counts for {len(self.values)} values (one each)"
            )
        if sum(self.counts) > MAX_OBSERVATIONS:
            raise ValueError(f"counts: more than {MAX_OBSERVATIONS:,} observations in all")
        if len(set(self.values)) < 2:
            raise ValueError("values: need at least 2 distinct values to fit a distribution")
        return self

    def observations(self) -> NDArray[np.float64]:
        return np.repeat(np.asarray(self.values, dtype=np.float64), self.counts)


class WorkloadSamples(Frozen):
    format: Literal["pearl.workload_samples"] = Field(description="What this file is.")
    schema_version: Literal[1] = Field(description="Schema version of this format.")
    description: str = Field("", description="What the samples are, in words.")
    sources: list[Source] = Field([], description="Where the observations come from.")
    regenerate: str = Field("", description="The command that writes this file.")
    turns_per_trajectory: Samples = Field(description="Turns (model calls) per trajectory.")
    prompt_tokens: Samples = Field(description="Tokens of a trajectory's first input.")
    observation_tokens: Samples = Field(
        description="Tokens the environment appends before a turn after the first."
    )
    output_tokens: Samples = Field(description="Tokens a turn generates.")
    tool_latency_s: Samples = Field(description="Seconds of one environment (tool) step.")

    @model_validator(mode="after")
    def _whole_numbers(self) -> WorkloadSamples:
        for name in INTEGER_COMPONENTS:
            samples: Samples = getattr(self, name)
            for i, value in enumerate(samples.values):
                if value != int(value):
                    raise ValueError(f"{name}.values[{i}]: {value!r} is not a whole number")
        return self


class WindowRow(Frozen):
    start_s: NonNegative = Field(description="When the GPUs become available.")
    end_s: Positive = Field(description="When the owner reclaims them.")
    num_gpus: Annotated[int, Field(ge=GPUS_PER_NODE, le=1_000_000)] = Field(
        description=f"GPUs of the window, whole nodes of {GPUS_PER_NODE}."
    )

    @model_validator(mode="after")
    def _valid(self) -> WindowRow:
        if self.end_s <= self.start_s:
            raise ValueError(f"end_s: {self.end_s:g} is not after start_s {self.start_s:g}")
        if self.num_gpus % GPUS_PER_NODE:
            raise ValueError(
                f"num_gpus: {self.num_gpus} is not a multiple of {GPUS_PER_NODE} (whole nodes)"
            )
        return self


class AvailabilityWindows(Frozen):
    format: Literal["pearl.availability_windows"] = Field(description="What this file is.")
    schema_version: Literal[1] = Field(description="Schema version of this format.")
    description: str = Field("", description="What the windows are, in words.")
    time_origin: str = Field("", description="What time 0 of start_s and end_s is.")
    sources: list[Source] = Field([], description="Where the windows come from.")
    regenerate: str = Field("", description="The command that writes this file.")
    windows: list[WindowRow] = Field(min_length=1, max_length=MAX_WINDOWS)


def shipped(name: str) -> Path:
    """The path of a file shipped in ``pearl/data`` (installed as package data)."""
    return Path(str(resources.files("pearl") / "data" / name))


def _read(path: Path, expected: str) -> Any:
    data = read_document(path)
    if not isinstance(data, dict):
        raise InputError(path, "", "expected a JSON object")
    if data.get("format") != expected:
        raise InputError(path, "format", f"expected {expected!r}, got {data.get('format')!r}")
    return data


def read_workload_samples(path: Path) -> dict[str, NDArray[np.float64]]:
    """The observations of every component, keyed like ``fit_trajectory_model``'s keywords."""
    doc = parse(WorkloadSamples, _read(path, WORKLOAD_FORMAT), path)
    return {kw: getattr(doc, name).observations() for name, kw in COMPONENTS.items()}


@cache
def _all_windows(path: Path) -> tuple[WindowRow, ...]:
    return tuple(parse(AvailabilityWindows, _read(path, WINDOWS_FORMAT), path).windows)


def read_windows(path: Path, *, gpu_type: str, min_duration_s: float) -> tuple[Window, ...]:
    """The file's windows that last at least ``min_duration_s``, granted as ``gpu_type``."""
    rows = _all_windows(path)
    kept = (w for w in rows if w.end_s - w.start_s >= min_duration_s)
    return tuple(sorted(Window(w.start_s, w.end_s, w.num_gpus, gpu_type) for w in kept))


# --- writing (benchmarks/derive_data.py) -------------------------------------------------


def _runs(values: NDArray[Any], keep_order: bool) -> tuple[list[Any], list[int]]:
    """(value, count) runs: consecutive repeats when ``keep_order``, else sorted distinct."""
    if not keep_order:
        distinct, counts = np.unique(values, return_counts=True)
        return distinct.tolist(), counts.tolist()
    out_values: list[Any] = []
    out_counts: list[int] = []
    for value in values.tolist():
        if out_values and out_values[-1] == value:
            out_counts[-1] += 1
        else:
            out_values.append(value)
            out_counts.append(1)
    return out_values, out_counts


def _render(head: dict[str, Any], arrays: Iterable[tuple[str, str]]) -> str:
    """JSON with the header indented and each long array on one line (compact, diffable)."""
    lines = ["{"]
    for key, value in head.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(value, indent=2)},".replace("\n", "\n  "))
    lines.extend(f"  {json.dumps(key)}: {body}," for key, body in arrays)
    lines[-1] = lines[-1].removesuffix(",")
    return "\n".join([*lines, "}"]) + "\n"


def render_workload_samples(
    observations: dict[str, NDArray[Any]],
    *,
    description: str,
    sources: list[Source],
    regenerate: str,
) -> str:
    """The workload file of ``observations`` (keyed like ``read_workload_samples`` returns).

    Lengths and latencies are written as sorted distinct values (their order does not
    matter to the fit); the turns keep their order (they are drawn by index)."""
    head = {
        "format": WORKLOAD_FORMAT,
        "schema_version": 1,
        "description": description,
        "sources": [s.model_dump() for s in sources],
        "regenerate": regenerate,
    }
    arrays = []
    for name, kw in COMPONENTS.items():
        values, counts = _runs(np.asarray(observations[kw]), keep_order=kw == "turns_per_session")
        arrays.append((name, json.dumps({"values": values, "counts": counts})))
    return _render(head, arrays)


def render_windows(
    windows: Iterable[Window],
    *,
    description: str,
    time_origin: str,
    sources: list[Source],
    regenerate: str,
) -> str:
    """The availability file of ``windows`` (their GPU type is the scenario's, not written)."""
    head = {
        "format": WINDOWS_FORMAT,
        "schema_version": 1,
        "description": description,
        "time_origin": time_origin,
        "sources": [s.model_dump() for s in sources],
        "regenerate": regenerate,
    }
    rows = ",\n    ".join(
        json.dumps({"start_s": w.start_s, "end_s": w.end_s, "num_gpus": w.num_gpus})
        for w in sorted(windows)
    )
    return _render(head, [("windows", f"[\n    {rows}\n  ]")])
