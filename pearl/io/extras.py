"""pearl's optional dependencies (the extras of ``pyproject.toml``), imported where needed.

The core (``pearl plan``, ``pearl simulate``, ``pearl bench decide|predictor|sim``) needs
only numpy, scipy, pydantic and pyyaml. A command that needs more calls :func:`require`
before importing the modules that use it; a missing module becomes an ``InputError``, which
the command line prints as one line naming the extra to install (exit status 2).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from pearl.io.documents import InputError

# The module each extra brings that pearl imports; the extra's name as in pyproject.toml.
EXTRA_OF_MODULE = {
    "submitit": "slurm",
    "mpi4py": "slurm",
    "matplotlib": "analysis",
    "torch": "engine",
    "safetensors": "engine",
    "tokenizers": "engine",
    "jinja2": "engine",
    "fastapi": "engine",
    "uvicorn": "engine",
    "prometheus_client": "engine",
    "rich": "engine",
    "megatron": "megatron",  # megatron-core's package (pearl.trainer.megatron)
    "transformers": "dev",  # the naive baseline of ``pearl bench engine``
}


def require(module: str) -> ModuleType:
    """Import ``module`` (a key of ``EXTRA_OF_MODULE``), or raise an ``InputError`` saying
    which extra to install: ``<environment>: MODULE: not installed; pip install 'pearl[X]'``."""
    extra = EXTRA_OF_MODULE[module]
    try:
        return importlib.import_module(module)
    except ImportError as err:  # absent, or present but broken (one of its own imports)
        absent = isinstance(err, ModuleNotFoundError) and err.name == module
        problem = "not installed" if absent else f"cannot be imported ({err})"
        raise InputError(
            "<environment>", module, f"{problem}; pip install 'pearl[{extra}]'"
        ) from None
