"""Loading a scenario document (``benchmarks/scenarios/*.yaml``) with one-line errors.

``load_scenario`` reads the YAML (or JSON) file, validates it as
``pearl.sim.scenario.Scenario``, loads the runtime profile it names (a shipped profile, or
a file relative to the scenario) and checks that every GPU type the scenario names is in
that profile. Every problem is an ``InputError``: ``FILE: FIELD: PROBLEM``.
"""

from __future__ import annotations

from pathlib import Path

from pearl.core.profile import RuntimeProfile
from pearl.io.documents import InputError, load_profile, parse, read_document
from pearl.sim.scenario import Scenario


def load_scenario(path: str | Path) -> Scenario:
    """The validated scenario at ``path``; see the module docstring."""
    return load_scenario_and_profile(path)[0]


def load_scenario_and_profile(path: str | Path) -> tuple[Scenario, RuntimeProfile]:
    """The validated scenario at ``path`` and the runtime profile it names."""
    p = Path(path)
    scenario = parse(Scenario, read_document(p), p)
    profile = load_profile(scenario.profile, relative_to=p.parent, named_in=p)
    known = ", ".join(sorted(profile.gpus))
    for field, gpu_type in scenario.gpu_types():
        if gpu_type not in profile.gpus:
            raise InputError(
                p, field, f"GPU type {gpu_type!r} is not in profile {scenario.profile} ({known})"
            )
    return scenario, profile
