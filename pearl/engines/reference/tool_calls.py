"""TEMPORARY stand-in (replaced by the models branch)."""
from __future__ import annotations
from typing import Any

def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    return text, []
