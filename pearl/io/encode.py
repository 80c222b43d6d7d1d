"""Plain JSON for the core's output dataclasses and models (infinities become null)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import TypeAdapter


def to_jsonable(obj: Any) -> Any:
    return TypeAdapter(type(obj)).dump_python(obj, mode="json")


def dumps(obj: Any, indent: int | None = 2) -> str:
    return json.dumps(to_jsonable(obj), indent=indent, allow_nan=False)
