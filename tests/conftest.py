"""Fixtures shared by the test folders: one tiny model directory for the session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 written by ``init_model`` with its defaults (seed 0); read it, do not
    change it."""
    pytest.importorskip("torch", reason="needs the engine extra: pip install 'pearl[engine]'")
    from pearl.engines.reference.tiny import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny")
