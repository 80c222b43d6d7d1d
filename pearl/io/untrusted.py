"""How pearl parses untrusted text: the one place every reader of a document, a log line,
a peer's message or a request body goes through.

A document from a user or a message from a peer can be hostile as well as careless. Each
parse is bounded so that no single input makes pearl allocate without bound or crash:

- size: at most ``max_bytes`` (each caller states its own; a file at most
  ``MAX_DOCUMENT_BYTES``);
- depth: objects and lists nested at most ``MAX_DEPTH`` deep (Python's parsers recurse:
  ``[[[[...`` of a few KB would otherwise raise ``RecursionError`` from anywhere);
- values: at most ``MAX_VALUES`` in all, counted as walked (a YAML alias bomb, a few
  hundred bytes that expand to billions of values, stops there instead of hanging);
- text: valid Unicode (JSON's ``"\\ud800"`` is refused: no log could write it);
- numbers: finite (``NaN``, ``Infinity``, ``.inf`` and ``1e999`` are refused: they pass
  most range checks and then fail at output or hang a loop).

Each problem raises one ``UntrustedInput`` with the field path (``a.b[3]``) and the
problem; readers add their file or peer and turn it into their one-line error.
"""

from __future__ import annotations

import json
import math
from typing import Any

import yaml

MAX_DOCUMENT_BYTES = 64 * 2**20  # an input file at most (the largest shipped: < 1 MiB)
MAX_DEPTH = 32  # nesting of objects and lists (pearl's deepest schema: under 10)
MAX_VALUES = 16_000_000  # values in one document (1M trajectories in flight: ~6M)

_YamlLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class UntrustedInput(ValueError):
    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field or '(document)'}: {problem}")
        self.field, self.problem = field, problem


def loads_json(data: bytes | bytearray | str, *, max_bytes: int) -> Any:
    """One JSON value from ``data``, within the bounds of this module."""
    _check_size(len(data), max_bytes)
    try:
        value = json.loads(data)  # NaN, Infinity, 1e999 parse as floats: the walk names them
    except json.JSONDecodeError as err:
        raise UntrustedInput(f"line {err.lineno}", f"malformed JSON: {err.msg}") from None
    except UnicodeDecodeError:
        raise UntrustedInput("", "not UTF-8 text") from None
    except RecursionError:
        raise UntrustedInput("", f"nested more than {MAX_DEPTH} deep") from None
    return checked(value)


def loads_yaml(text: str, *, max_bytes: int) -> Any:
    """One YAML document from ``text``, within the bounds of this module."""
    _check_size(len(text.encode("utf-8", "surrogatepass")), max_bytes)
    try:
        value = yaml.load(text, Loader=_YamlLoader)  # CSafeLoader or SafeLoader: no tags run code
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UntrustedInput(where, f"malformed YAML: {problem}") from None
    except RecursionError:
        raise UntrustedInput("", f"nested more than {MAX_DEPTH} deep") from None
    return checked(value)


def checked(doc: Any) -> Any:
    """``doc`` if no value nests deeper than ``MAX_DEPTH``, it expands to at most
    ``MAX_VALUES`` values and every number is finite. A container that YAML shares
    (an alias) is walked once and counted at every place it appears, so the walk costs
    the text's size, not the expansion's."""
    if isinstance(doc, dict | list):
        _walk(doc, None, 0, {})
    elif isinstance(doc, float) and not math.isfinite(doc):
        raise UntrustedInput("", f"{doc} is not a finite number")
    elif isinstance(doc, str):
        _check_text(doc, None)
    return doc


_Where = tuple[Any, str | int] | None  # (parent's where, key): the path, built on error


def _walk(value: Any, where: _Where, depth: int, sizes: dict[int, int]) -> int:
    """The number of values ``value`` expands to; ``sizes`` of the containers walked."""
    if depth >= MAX_DEPTH:
        raise UntrustedInput(_path(where), f"nested more than {MAX_DEPTH} deep")
    known = sizes.get(id(value))
    if known is not None:
        return known
    items = value.items() if isinstance(value, dict) else enumerate(value)
    size = 1
    for key, item in items:
        if isinstance(key, str):
            _check_text(key, (where, "(key)"))
        if isinstance(item, dict | list):
            size += _walk(item, (where, key), depth + 1, sizes)
            continue
        size += 1
        if isinstance(item, float) and not math.isfinite(item):
            raise UntrustedInput(_path((where, key)), f"{item} is not a finite number")
        if isinstance(item, str):
            _check_text(item, (where, key))
    if size > MAX_VALUES:
        problem = f"expands to more than {MAX_VALUES} values (YAML aliases)"
        raise UntrustedInput(_path(where), problem)
    sizes[id(value)] = size
    return size


def _path(where: _Where) -> str:
    keys: list[str | int] = []
    while where is not None:
        where, key = where
        keys.append(key)
    return join_field(*(f"[{k}]" if isinstance(k, int) else str(k) for k in reversed(keys)))


def join_field(*parts: str) -> str:
    """``a``, ``b``, ``[3]`` -> ``a.b[3]``."""
    return ".".join(p for p in parts if p).replace(".[", "[")


def _check_text(text: str, where: _Where) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # "\ud800" in JSON: text no file or log could hold
        problem = "text with a lone surrogate (not valid Unicode)"
        raise UntrustedInput(_path(where), problem) from None


def _check_size(size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise UntrustedInput("", f"{size} bytes: more than the {max_bytes} allowed")
