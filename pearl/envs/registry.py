"""Environments by name, built from a config section.

A section is a mapping ``{name: NAME, ...fields}``: the fields are validated by the
environment's config model (unknown ones rejected), and an optional ``tool_latency:
{source, scale, seed}`` wraps the environment in ``WithToolLatency``. Every problem is an
``InputError`` naming the file and the field (``FILE: env.digits: ...``).

The shipped environments are registered below; ``register`` adds more (a name once).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from pearl.envs.arithmetic import ArithmeticConfig, SingleDigit, SingleDigitConfig, arithmetic
from pearl.envs.broken import Broken, BrokenConfig
from pearl.envs.latency import ToolLatencyConfig, WithToolLatency, latency_samples
from pearl.envs.protocol import Environment
from pearl.envs.python_task import PythonTaskConfig, python_task
from pearl.io.documents import InputError, parse

WRAPPER_FIELDS = ("tool_latency",)


@dataclass(frozen=True)
class Registered:
    name: str
    factory: Callable[[Any], Environment]  # takes a validated config_model
    config_model: type[BaseModel]


_REGISTRY: dict[str, Registered] = {}


def register(
    name: str, factory: Callable[[Any], Environment], config_model: type[BaseModel]
) -> None:
    if name in _REGISTRY:
        raise ValueError(f"environment {name!r} is registered already")
    _REGISTRY[name] = Registered(name, factory, config_model)


def names() -> list[str]:
    return sorted(_REGISTRY)


def config_of(
    section: Any, path: str | Path, field: str = "env"
) -> tuple[Registered, BaseModel, ToolLatencyConfig | None]:
    """The registration, its validated config and the latency wrapper's, or an
    ``InputError``."""
    if not isinstance(section, Mapping):
        raise InputError(path, field, "expected a mapping with a 'name'")
    name = section.get("name")
    if not isinstance(name, str):
        raise InputError(path, f"{field}.name", "missing: the environment's name")
    entry = _REGISTRY.get(name)
    if entry is None:
        known = ", ".join(names())
        raise InputError(path, f"{field}.name", f"unknown environment {name!r} (known: {known})")
    fields = {k: v for k, v in section.items() if k != "name" and k not in WRAPPER_FIELDS}
    config = parse(entry.config_model, fields, path, field)
    latency = section.get("tool_latency")
    wrapper = None
    if latency is not None:
        wrapper = parse(ToolLatencyConfig, latency, path, f"{field}.tool_latency")
    return entry, config, wrapper


def make(
    section: Any, path: str | Path, field: str = "env", relative_to: Path | None = None
) -> Environment:
    """The environment a config section describes (``relative_to``: where a relative
    ``tool_latency.source`` is; the config file's folder by default)."""
    entry, config, latency = config_of(section, path, field)
    env = entry.factory(config)
    if latency is None:
        return env
    folder = relative_to if relative_to is not None else Path(path).parent
    samples_s = latency_samples(latency.source, folder)
    return WithToolLatency(env, samples_s, np.random.default_rng(latency.seed), latency.scale)


register("arithmetic", arithmetic, ArithmeticConfig)
register("single_digit", SingleDigit, SingleDigitConfig)
register("python", python_task, PythonTaskConfig)


def _broken(kind: str) -> Callable[[BrokenConfig], Environment]:
    return lambda config: Broken(kind, config)


for _kind in ("crashing", "hanging", "chatty"):
    register(_kind, _broken(_kind), BrokenConfig)
