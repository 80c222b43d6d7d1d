"""Where the tests find the raw public traces (a plain module, not a conftest).

pearl ships what it needs derived from them (``pearl/data``); only the tests that read a raw
third-party file as such use this: the raw trace readers, the sacct fixtures, the checks
that the shipped data and the profiles' calibration equal what the raw files give. The
traces live beside the repository (``../shared/traces``, or ``$PEARL_TRACES``). When the
folder is missing those tests are skipped, each with its reason, except under CI (``$CI``
set), where a missing folder is a failure: CI has ``../shared``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pearl.io.traces import traces_dir


def traces_or_skip(why: str) -> Path:
    """The raw traces' folder; ``why`` says what the calling test reads from it."""
    directory = traces_dir()
    if not directory.is_dir():
        reason = f"raw public traces not found at {directory} (set PEARL_TRACES): {why}"
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI must have them")
        pytest.skip(reason)
    return directory
