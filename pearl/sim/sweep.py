"""The grid of ``pearl sweep``: scenario variants from ``--vary FIELD=V1,V2,...`` axes, and
pearl's ratio to each baseline across it.

A field is a dotted path in the scenario document (``rollout.group_size``,
``elastic.trace.max_gpus``, ``policy.elastic.min_gain_s_per_gpu``); several axes make
their cartesian product, in the order given (the last axis varies fastest). A variant is
the scenario document with the point's values set; a field the document leaves out (a
default) is added, and the scenario's own validation then names a field that does not
exist. Pure: documents in, documents and figures out.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pearl.core.limits import MAX_SWEEP_POINTS

Point = tuple[tuple[str, Any], ...]  # ((field, value), ...), one per axis


class SweepError(ValueError):
    """A bad axis or point: ``field`` names it, ``problem`` says what is wrong."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


@dataclass(frozen=True)
class Axis:
    field: str  # dotted path in the scenario document
    values: tuple[Any, ...]


def check_axes(axes: Sequence[Axis]) -> None:
    """Every field a dotted path of names, none twice, each with at least one value, and
    no more points in all than ``MAX_SWEEP_POINTS``."""
    seen: set[str] = set()
    for axis in axes:
        parts = axis.field.split(".")
        if not all(p.isidentifier() for p in parts):
            raise SweepError(axis.field, "not a dotted path of field names")
        if axis.field in seen:
            raise SweepError(axis.field, "varied twice")
        if not axis.values:
            raise SweepError(axis.field, "no values")
        seen.add(axis.field)
    points = math.prod(len(a.values) for a in axes)
    if points > MAX_SWEEP_POINTS:
        raise SweepError(axes[-1].field, f"{points} points: more than {MAX_SWEEP_POINTS}")


def grid(axes: Sequence[Axis]) -> list[Point]:
    """Every point of the axes' product, the last axis varying fastest."""
    check_axes(axes)
    fields = [a.field for a in axes]
    return [
        tuple(zip(fields, values, strict=True))
        for values in itertools.product(*(a.values for a in axes))
    ]


def with_point(doc: Mapping[str, Any], point: Point) -> dict[str, Any]:
    """A copy of the scenario document with the point's values set (see the module
    docstring); a path through a value that is not a mapping is a ``SweepError``."""
    out = _copied(doc)
    for field, value in point:
        node: dict[str, Any] = out
        *parents, leaf = field.split(".")
        walked = []
        for name in parents:
            walked.append(name)
            child = node.setdefault(name, {})
            if not isinstance(child, dict):
                raise SweepError(field, f"{'.'.join(walked)} is {child!r}, not a mapping")
            node = child
        node[leaf] = value
    return out


def _copied(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a document's mappings and lists (its scalars are immutable)."""

    def copied(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: copied(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [copied(v) for v in value]
        return value

    return {k: copied(v) for k, v in doc.items()}


def label(point: Point) -> str:
    return ", ".join(f"{field}={value}" for field, value in point)


def ratios(throughput: Mapping[str, float], of: str = "pearl") -> dict[str, float]:
    """``of``'s throughput over each other policy's (NaN where that one is 0)."""
    mine = throughput[of]
    return {
        name: (mine / tph if tph > 0 else math.nan)
        for name, tph in throughput.items()
        if name not in (of, "oracle")
    }


def worst(rows: Sequence[tuple[Point, Mapping[str, float]]]) -> dict[str, tuple[float, Point]]:
    """Per baseline, pearl's smallest ratio over the grid and the point it is at."""
    out: dict[str, tuple[float, Point]] = {}
    for point, by_name in rows:
        for name, ratio in by_name.items():
            if name not in out or ratio < out[name][0]:
                out[name] = (ratio, point)
    return out
