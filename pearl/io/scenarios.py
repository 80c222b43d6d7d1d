"""Loading a scenario document (``benchmarks/scenarios/*.yaml``) with one-line errors.

``load_scenario`` reads the YAML (or JSON) file, validates it as
``pearl.sim.scenario.Scenario``, loads the runtime profile it names (a shipped profile, or
a file relative to the scenario), checks that every GPU type the scenario names is in
that profile, and resolves the data files it names (``$VARIABLES`` and ``~`` expanded, a
relative path taken from the scenario's folder) to absolute paths that exist. Every
problem is an ``InputError``: ``FILE: FIELD: PROBLEM``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pearl.core.profile import RuntimeProfile
from pearl.io.documents import (
    InputError,
    load_profile,
    parse,
    read_document,
)
from pearl.io.policy_names import check_policy_names
from pearl.sim.scenario import Scenario


def load_scenario(path: str | Path) -> Scenario:
    """The validated scenario at ``path``; see the module docstring."""
    return load_scenario_and_profile(path)[0]


def load_scenario_and_profile(path: str | Path) -> tuple[Scenario, RuntimeProfile]:
    """The validated scenario at ``path`` and the runtime profile it names."""
    return scenario_of_document(read_document(path), path)


def scenario_of_document(doc: Any, path: str | Path) -> tuple[Scenario, RuntimeProfile]:
    """``doc`` validated as the scenario file at ``path`` would be (a variant of it:
    ``pearl sweep``), with the runtime profile it names."""
    p = Path(path)
    scenario = parse(Scenario, doc, p)
    check_policy_names(scenario.policy, p, "policy")
    profile = load_profile(scenario.profile, relative_to=p.parent, named_in=p)
    known = ", ".join(sorted(profile.gpus))
    for field, gpu_type in scenario.gpu_types():
        if gpu_type not in profile.gpus:
            raise InputError(
                p, field, f"GPU type {gpu_type!r} is not in profile {scenario.profile} ({known})"
            )
    return _resolve_data_paths(scenario, p), profile


def _resolve_data_paths(scenario: Scenario, path: Path) -> Scenario:
    rollout = scenario.rollout
    rollout = rollout.model_copy(
        update={
            "workload_file": _data_path(path, "rollout.workload_file", rollout.workload_file),
            "traces_dir": _data_path(path, "rollout.traces_dir", rollout.traces_dir, folder=True),
        }
    )
    elastic = scenario.elastic
    if elastic.trace is not None:
        t = elastic.trace
        trace = t.model_copy(
            update={
                "windows_file": _data_path(path, "elastic.trace.windows_file", t.windows_file),
                "idle_series_file": _data_path(
                    path, "elastic.trace.idle_series_file", t.idle_series_file
                ),
            }
        )
        elastic = elastic.model_copy(update={"trace": trace})
    return scenario.model_copy(update={"rollout": rollout, "elastic": elastic})


def _data_path(scenario: Path, field: str, value: str | None, folder: bool = False) -> str | None:
    """``value`` expanded and made absolute against the scenario's folder; it must exist."""
    if value is None:
        return None
    expanded = os.path.expanduser(os.path.expandvars(value))
    if "$" in expanded:
        raise InputError(scenario, field, f"{value!r}: an environment variable in it is not set")
    resolved = (scenario.parent / expanded).resolve()
    kind, exists = ("folder", resolved.is_dir()) if folder else ("file", resolved.is_file())
    if not exists:
        raise InputError(scenario, field, f"{value!r}: no such {kind} ({resolved})")
    return str(resolved)
