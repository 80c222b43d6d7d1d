"""The fuzz suite's settings, ``@FUZZ`` on every fuzz test, in two profiles: ``ci``
(the default: 30 examples per test, the same on every run, so the whole suite
stays fast and a red run reproduces) and ``long`` (``PEARL_FUZZ=long pytest tests/fuzz``:
many more, random examples, for a developer hunting bugs).

Every fuzz test asserts one property of a surface: bad input gets exit 2 and one line
naming the file, field and problem (a 4xx JSON error for a server; a skip-and-count
where the reader is documented as tolerant), never a traceback, never a hang past a
bound, never a server that stops serving others.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_PROFILES: dict[str, settings] = {
    "ci": settings(
        max_examples=30,
        deadline=None,
        derandomize=True,  # the same cases on every CI run: a red run reproduces
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    ),
    "long": settings(
        max_examples=2_000,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    ),
}
FUZZ = _PROFILES[os.environ.get("PEARL_FUZZ", "ci")]  # not loaded globally: others keep theirs
