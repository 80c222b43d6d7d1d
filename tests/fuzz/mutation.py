"""Hypothesis strategies that turn a valid document into a careless or hostile one.

``mutated(doc)`` draws one document from a valid ``doc``: one to three edits, each at a
path drawn from the document's own (so the edits reach deep fields, not only the top):
a value replaced by a hostile one (``NaN``, ``1e300``, ``-1``, ``2**63``, a 5,000-char
string, a lone surrogate, 50-deep lists, a wrong type), a key dropped, an unknown key
added, a list item duplicated (a duplicate id) or a list emptied. ``mangled(text)`` draws
a text-level wreck instead: cut short, bytes flipped, junk spliced in.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from hypothesis import strategies as st

Path = tuple[str | int, ...]


def _deep(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


HOSTILE_VALUES: list[Any] = [
    None,
    True,
    0,
    -1,
    -1e-9,
    1e300,
    -1e300,
    10**30,
    2**63,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "x" * 5000,
    "\ud800",
    "nan",
    "1e999",
    [],
    {},
    _deep(50),
    {"kind": "allocation_granted"},
]

hostile_value = st.one_of(
    st.sampled_from(HOSTILE_VALUES),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)


def paths(doc: Any, prefix: Path = ()) -> list[Path]:
    """Every path in ``doc`` (the root ``()`` included)."""
    found = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            found += paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found += paths(value, (*prefix, i))
    return found


def _parent(doc: Any, path: Path) -> tuple[Any, str | int]:
    node = doc
    for key in path[:-1]:
        node = node[key]
    return node, path[-1]


def _edit(doc: Any, path: Path, op: str, value: Any) -> Any:
    if not path:
        return value if op == "replace" else doc
    parent, key = _parent(doc, path)
    if op == "replace":
        parent[key] = value
    elif op == "drop" and isinstance(parent, dict):
        del parent[key]
    elif op == "unknown_key" and isinstance(parent, dict):
        parent[f"unknown_{key}"] = value
    elif op == "duplicate" and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[key]))
    elif op == "empty" and isinstance(parent[key], list | dict):
        parent[key] = type(parent[key])()
    return doc


@st.composite
def mutated(draw: st.DrawFn, doc: Any) -> Any:
    """``doc`` with one to three edits (see the module docstring)."""
    out = copy.deepcopy(doc)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        path = draw(st.sampled_from(paths(out)))
        op = draw(st.sampled_from(["replace", "replace", "replace", "drop", "unknown_key"]))
        if path and isinstance(path[-1], int):
            op = draw(st.sampled_from(["replace", "duplicate", "empty"]))
        out = _edit(out, path, op, copy.deepcopy(draw(hostile_value)))  # never share one
    return out


@st.composite
def mangled(draw: st.DrawFn, text: bytes) -> bytes:
    """``text`` cut short, with bytes flipped or junk spliced in."""
    kind = draw(st.sampled_from(["cut", "flip", "splice"]))
    at = draw(st.integers(min_value=0, max_value=max(len(text) - 1, 0)))
    if kind == "cut":
        return text[:at]
    if kind == "flip":
        return text[:at] + bytes([text[at] ^ 0xFF]) + text[at + 1 :] if text else b"\xff"
    junk = draw(st.sampled_from([b"\x00", b"\xff\xfe", b"[" * 3000, b"{", b"&a [*a]", b"\n"]))
    return text[:at] + junk + text[at:]
