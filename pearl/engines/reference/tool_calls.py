"""Tool calls in generated text, Hermes/Qwen style: each ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` block becomes an OpenAI ``tool_calls`` entry, as vLLM's
``hermes`` parser returns them.

Call ids are ``call_`` and 24 hex digits: derived from ``id_seed`` and the call's index when
one is given (a request id: the same text gives the same ids), else random.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from typing import Any

# A block, or an unterminated one running to the end (generation stopped inside it).
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
_ID_HEX_DIGITS = 24


def parse_tool_calls(
    text: str, id_seed: str | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)``: the text outside the parsed blocks, stripped (None when
    empty), and one ``{"id", "type": "function", "function": {"name", "arguments"}}`` per
    block, ``arguments`` a JSON string. A block that is not a JSON object with a string
    ``name`` (and an object ``arguments``, when present) stays in the content."""
    calls: list[dict[str, Any]] = []
    content: list[str] = []
    end = 0
    for match in _BLOCK.finditer(text):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        function = _function(body)
        if function is None:
            continue  # left in the content
        content.append(text[end : match.start()])
        end = match.end()
        calls.append(
            {"id": _call_id(id_seed, len(calls)), "type": "function", "function": function}
        )
    content.append(text[end:])
    rest = "".join(content).strip()
    return (rest or None), calls


def _function(body: str) -> dict[str, str] | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}


def _call_id(seed: str | None, index: int) -> str:
    if seed is None:
        return f"call_{uuid.uuid4().hex[:_ID_HEX_DIGITS]}"
    digest = hashlib.sha256(f"{seed}\0{index}".encode()).hexdigest()
    return f"call_{digest[:_ID_HEX_DIGITS]}"
