"""Reading input documents (JSON or YAML) into typed models, with one-line errors.

Every problem becomes an ``InputError`` naming the file, the field and the problem; the
command line prints it as one line and exits with status 2.
"""

from __future__ import annotations

import json
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pearl.core.profile import RuntimeProfile

M = TypeVar("M", bound=BaseModel)

_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class InputError(Exception):
    def __init__(self, path: str | Path, field: str, problem: str) -> None:
        super().__init__(f"{path}: {field or '(document)'}: {problem}")
        self.path, self.field, self.problem = str(path), field, problem


MAX_DOCUMENT_BYTES = 64 * 2**20  # an input document at most (the largest shipped: < 1 MiB)
MAX_DEPTH = 32  # nesting of objects and lists (pearl's deepest schema: under 10)


def read_document(path: str | Path) -> Any:
    """Parse a JSON or YAML file (by suffix; YAML when unsure), as pearl reads every
    document it is given: at most ``MAX_DOCUMENT_BYTES``, nested at most ``MAX_DEPTH``
    deep, every number finite (``NaN``, ``Infinity``, ``.inf``, ``1e999`` are refused).
    Each problem is one ``InputError``."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_DOCUMENT_BYTES:
            problem = f"{size} bytes: more than the {MAX_DOCUMENT_BYTES} a document may have"
            raise InputError(p, "", problem)
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(p, "", "no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise InputError(p, "", f"cannot read: {err.__class__.__name__}") from None
    return _checked(p, _parse(p, text))


def _parse(p: Path, text: str) -> Any:
    try:
        if p.suffix == ".json":
            try:
                return json.loads(text)  # NaN, Infinity: floats the walk names
            except json.JSONDecodeError as err:
                where = f"line {err.lineno}"
                raise InputError(p, where, f"malformed JSON: {err.msg}") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise InputError(p, where, f"malformed YAML: {problem}") from None
    except RecursionError:
        raise InputError(p, "", f"nested more than {MAX_DEPTH} deep") from None


def _checked(p: Path, doc: Any) -> Any:
    """``doc`` if no value nests deeper than ``MAX_DEPTH`` and every number is finite."""
    stack: list[tuple[Any, str, int]] = [(doc, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(p, where, f"{value} is not a finite number")
        if isinstance(value, dict | list):
            if depth >= MAX_DEPTH:
                raise InputError(p, where, f"nested more than {MAX_DEPTH} deep")
            if isinstance(value, dict):
                named = [(str(k), v) for k, v in value.items()]
            else:
                named = [(f"[{i}]", v) for i, v in enumerate(value)]
            stack += [(item, _join(where, key), depth + 1) for key, item in named]
    return doc


def read_object(path: str | Path) -> dict[str, Any]:
    """A JSON or YAML file that must hold one object (a mapping)."""
    doc = read_document(path)
    if not isinstance(doc, dict):
        raise InputError(path, "", "must be a JSON object")
    return doc


def parse(model: type[M], data: Any, path: str | Path, field: str = "") -> M:
    """Validate ``data`` as ``model``; the first problem becomes an ``InputError``."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc, problem = _split(first["loc"], first["msg"])
        more = err.error_count() - 1
        if more:
            problem += f" (and {more} more problem{'s' if more > 1 else ''})"
        raise InputError(path, _join(field, loc), problem) from None


def load_profile(
    name_or_path: str, relative_to: Path | None = None, named_in: Path | None = None
) -> RuntimeProfile:
    """A shipped profile by name (``qwen3-8b``) or a YAML file by path (relative to
    ``relative_to``); an unknown one is reported against ``named_in``, the document that
    named it, when given."""
    shipped = resources.files("pearl") / "profiles" / f"{name_or_path}.yaml"
    if shipped.is_file():
        return parse(
            RuntimeProfile, yaml.safe_load(shipped.read_text()), f"<profile {name_or_path}>"
        )
    path = Path(name_or_path)
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    if not path.exists():
        names = ", ".join(shipped_profiles())
        raise InputError(
            named_in or path,
            "profile",
            f"{name_or_path!r} is neither a file nor a shipped profile ({names})",
        )
    return parse(RuntimeProfile, read_document(path), path)


def shipped_profiles() -> list[str]:
    folder = resources.files("pearl") / "profiles"
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def _split(loc: tuple[int | str, ...], msg: str) -> tuple[str, str]:
    """Field path and problem; model-level checks carry their field in the message."""
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    msg = msg.removeprefix("Value error, ")
    first = msg.split("; ")[0]
    m = _FIELD_PREFIX.match(first)
    if m:
        return _join(path, m.group(1)), first[m.end() :]
    return path, msg


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p).replace(".[", "[")
