"""pyproject.toml and environment.yml describe the same environment."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _names(requirements: list[str]) -> set[str]:
    return {
        re.split(r"[<>=!~ \[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements
    }


def test_environment_yml_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _names(project["dependencies"])
    wanted |= _names(project["optional-dependencies"]["slurm"])
    wanted |= _names(project["optional-dependencies"]["dev"])
    wanted |= _names(project["optional-dependencies"]["analysis"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = _names([d for d in env["dependencies"] if isinstance(d, str)])
    assert "conda-forge" in env["channels"]
    assert wanted <= conda, f"missing from environment.yml: {sorted(wanted - conda)}"
    assert conda - wanted <= {"python", "pip"}, f"only in environment.yml: {sorted(conda - wanted)}"


def test_python_requirement_agrees() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert project["requires-python"] == ">=3.11"
    assert "python>=3.11" in env["dependencies"]
