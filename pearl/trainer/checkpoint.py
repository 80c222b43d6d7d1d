"""Directories written whole, and the run's checkpoint directory.

A directory is written under a staging name beside its final one (``.NAME.tmp-PID-HEX``),
its files fsynced, then renamed into place (and the parent fsynced): a reader sees the
whole directory or none. An existing directory of that name is renamed aside first and
removed after (a reader sees the old one, briefly none, then the new one).

The checkpoint directory (``RUN_DIR/trainer/checkpoints``) holds ``step-NNNNNN/``: the
state after ``NNNNNN`` committed updates (the next batch to train is batch ``NNNNNN``).
Staging names never match ``step-NNNNNN``, so a checkpoint half written when the trainer
died is never the latest; the next prune removes what is left of it.

A checkpoint's files (``write_checkpoint``, ``read_checkpoint``): ``model.safetensors``
(float32 weights, Hugging Face names), ``optimizer.safetensors`` (the optimizer's
per-parameter state as ``<param name>.<key>``, generator states as ``rng.<name>``),
``trainer.json`` (format, step, version, the optimizer's hyperparameters, the trainer's
config) and the model's ``config.json`` (``docs/training.md``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from pearl.engines.reference.config import CONFIG_FILE, GENERATION_CONFIG_FILE
from pearl.io.documents import InputError, read_object

STEP_DIR = "step-{:06d}"
_STEP = re.compile(r"^step-(\d{6})$")
_STAGING = re.compile(r"^\..+\.tmp-\d+-[0-9a-f]+$")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield a staging directory to fill; on a clean exit it becomes ``path``. On an
    error the staging directory is removed and ``path`` is untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    staging.mkdir()
    try:
        yield staging
        for f in staging.rglob("*"):
            if f.is_file():
                _fsync(f)
        _fsync(staging)
        if path.exists():
            aside = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
            os.replace(path, aside)
            os.replace(staging, path)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(staging, path)
        _fsync(path.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remove_staging(folder: Path) -> list[Path]:
    """Remove what interrupted writes left in ``folder`` (staging directories)."""
    gone = [p for p in folder.iterdir() if p.is_dir() and _STAGING.match(p.name)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


class CheckpointDir:
    """``step-NNNNNN`` checkpoints under ``root``; the newest ``keep`` are kept."""

    def __init__(self, root: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep: at least 1 checkpoint, not {keep}")
        self.root, self.keep = root, keep

    def path(self, step: int) -> Path:
        return self.root / STEP_DIR.format(step)

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = (_STEP.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m is not None)

    def latest(self) -> tuple[int, Path] | None:
        steps = self.steps()
        return (steps[-1], self.path(steps[-1])) if steps else None

    def prune(self) -> list[Path]:
        """Remove all but the newest ``keep`` checkpoints, and staging leftovers."""
        if not self.root.is_dir():
            return []
        old = [self.path(s) for s in self.steps()[: -self.keep]]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
        return old + remove_staging(self.root)


# -- the checkpoint's files ---------------------------------------------------------------

MODEL_FILE = "model.safetensors"  # the weights, float32, Hugging Face names
OPTIMIZER_FILE = "optimizer.safetensors"  # "<param name>.<state key>" tensors, "rng.*"
STATE_FILE = "trainer.json"  # format, step, version, optimizer hyperparameters, config
FORMAT = "pearl-trainer-checkpoint/1"


@dataclass(frozen=True)
class CheckpointState:
    """What a checkpoint holds, as tensors and JSON."""

    step: int  # committed updates
    version: int  # the policy version of the weights
    weights: dict[str, torch.Tensor]  # Hugging Face names
    optimizer: dict[str, torch.Tensor]  # "<param name>.<key>": the optimizer's per-param state
    rng: dict[str, torch.Tensor]  # generator states
    param_groups: list[dict[str, Any]]  # the optimizer's hyperparameters, params as names
    config: dict[str, Any]  # the trainer's configuration (for the record)


def copy_model_config(model_dir: Path, d: Path) -> None:
    """The model directory's ``config.json`` and ``generation_config.json`` (where it has
    one) into ``d``: with a ``model.safetensors`` beside them, ``d`` loads as the model."""
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, d / name)


def write_checkpoint(path: Path, state: CheckpointState, model_dir: Path) -> None:
    """Write ``state`` to the directory ``path`` atomically, with the model's config files
    (so the directory also loads as a Hugging Face model)."""
    with atomic_dir(path) as d:
        save_file(state.weights, d / MODEL_FILE, metadata={"format": "pt"})
        rng = {f"rng.{k}": v for k, v in state.rng.items()}
        save_file(state.optimizer | rng, d / OPTIMIZER_FILE, metadata={"format": "pt"})
        copy_model_config(model_dir, d)
        doc = {
            "format": FORMAT,
            "step": state.step,
            "version": state.version,
            "param_groups": state.param_groups,
            "config": state.config,
        }
        (d / STATE_FILE).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def read_checkpoint(path: Path) -> CheckpointState:
    """The state in ``path``; an ``InputError`` naming the file and field if it is not a
    checkpoint this format wrote."""
    where = path / STATE_FILE
    doc = read_object(where)
    if doc.get("format") != FORMAT:
        raise InputError(where, "format", f"expected {FORMAT!r}, not {doc.get('format')!r}")
    for field in ("step", "version"):
        value = doc.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(where, field, f"must be a non-negative integer, not {value!r}")
    groups = doc.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise InputError(where, "param_groups", "must be a list of objects")
    config = doc.get("config")
    tensors = _load(path / OPTIMIZER_FILE)
    return CheckpointState(
        step=doc["step"],
        version=doc["version"],
        weights=_load(path / MODEL_FILE),
        optimizer={k: v for k, v in tensors.items() if not k.startswith("rng.")},
        rng={k[4:]: v for k, v in tensors.items() if k.startswith("rng.")},
        param_groups=groups,
        config=config if isinstance(config, dict) else {},
    )


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except FileNotFoundError:
        raise InputError(path, "", "no such file") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise InputError(path, "", f"not a safetensors file ({err})") from None
