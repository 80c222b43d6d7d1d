"""Where the tests find the public traces (a plain module, not a conftest).

The traces live beside the repository (``../shared/traces``, or ``$PEARL_TRACES``). When
the folder is missing the tests that need it are skipped with the reason, except under CI
(``$CI`` set), where a missing folder is a failure: CI has ``../shared``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pearl.traces import traces_dir


def traces_or_skip() -> Path:
    directory = traces_dir()
    if not directory.is_dir():
        reason = f"public traces not found at {directory} (set PEARL_TRACES)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI must have them")
        pytest.skip(reason)
    return directory
