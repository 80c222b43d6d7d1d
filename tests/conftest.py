"""Fixtures shared by the test folders: one tiny model directory for the session, and the
options that point the engine protocol conformance tests at engines already running."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engines", "engine protocol conformance")
    group.addoption(
        "--engine-url",
        default=None,
        help="run tests/engines/test_protocol_conformance.py against this running engine "
        "(e.g. vllm serve) instead of starting reference-engine processes",
    )
    group.addoption(
        "--peer-url",
        default=None,
        help="the second running engine (the PD decode side, the continuation); with --engine-url",
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 written by ``init_model`` with its defaults (seed 0); read it, do not
    change it."""
    pytest.importorskip("torch", reason="needs the engine extra: pip install 'pearl[engine]'")
    from pearl.engines.reference.tiny import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny")
