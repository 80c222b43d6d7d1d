"""Reading input documents (JSON or YAML) into typed models, with one-line errors.

Every problem becomes an ``InputError`` naming the file, the field and the problem; the
command line prints it as one line and exits with status 2.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pearl.core.profile import RuntimeProfile
from pearl.io.untrusted import (
    MAX_DOCUMENT_BYTES,
    UntrustedInput,
    join_field,
    loads_json,
    loads_yaml,
)

M = TypeVar("M", bound=BaseModel)

_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class InputError(Exception):
    """One line, always: a newline or another control character in a name or a value
    the problem quotes is escaped (``\\n``)."""

    def __init__(self, path: str | Path, field: str, problem: str) -> None:
        field, problem = one_line(field), one_line(problem)
        super().__init__(f"{one_line(str(path))}: {field or '(document)'}: {problem}")
        self.path, self.field, self.problem = str(path), field, problem

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled whole, its line as it reads (a process pool's worker raises one to its
        parent: ``pearl simulate --jobs``)."""
        return _rebuilt, (type(self), str(self), self.path, self.field, self.problem)

    @classmethod
    def relayed(cls, message: str, by: str) -> InputError:
        """The ``InputError`` a peer answered with (a trainer's 400: its message already
        reads ``FILE: FIELD: PROBLEM``), kept as it is."""
        err = cls(by, "", message)
        Exception.__init__(err, one_line(message))
        return err


def _rebuilt(
    cls: type[InputError], message: str, path: str, field: str, problem: str
) -> InputError:
    err = cls(path, field, problem)
    Exception.__init__(err, message)
    return err


def one_line(text: str) -> str:
    """``text`` with its control characters escaped, as ``repr`` writes them."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def read_document(path: str | Path) -> Any:
    """Parse a JSON or YAML file (by suffix; YAML when unsure) as pearl parses every
    untrusted text (``pearl.io.untrusted``: size, depth, expansion, finite numbers,
    valid text). Each problem is one ``InputError``."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_DOCUMENT_BYTES:
            problem = f"{size} bytes: more than the {MAX_DOCUMENT_BYTES} a document may have"
            raise InputError(p, "", problem)
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(p, "", "no such file") from None
    except (IsADirectoryError, NotADirectoryError, PermissionError) as err:
        raise InputError(p, "", f"cannot read: {err.__class__.__name__}") from None
    except UnicodeDecodeError:
        raise InputError(p, "", "not UTF-8 text") from None
    try:
        if p.suffix == ".json":
            return loads_json(text, max_bytes=MAX_DOCUMENT_BYTES)
        return loads_yaml(text, max_bytes=MAX_DOCUMENT_BYTES)
    except UntrustedInput as err:
        raise InputError(p, err.field, err.problem) from None


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
        raise InputError(path, join_field(field, loc), problem) from None


def load_profile(
    name_or_path: str, relative_to: Path | None = None, named_in: Path | None = None
) -> RuntimeProfile:
    """A shipped profile by name (``qwen3-8b``) or a YAML file by path (relative to
    ``relative_to``); an unknown one is reported against ``named_in``, the document that
    named it, when given."""
    shipped = resources.files("pearl") / "profiles" / f"{name_or_path}.yaml"
    if not name_or_path.isprintable() or len(name_or_path) > 4096:
        raise InputError(named_in or name_or_path, "profile", "not a profile name or a path")
    try:
        is_shipped = shipped.is_file()
    except OSError:  # a name too long for a file: not shipped, and checked as a path below
        is_shipped = False
    if is_shipped:
        return parse(
            RuntimeProfile, yaml.safe_load(shipped.read_text()), f"<profile {name_or_path}>"
        )
    path = Path(name_or_path)
    if relative_to is not None and not path.is_absolute():
        path = relative_to / path
    try:
        exists = path.exists()
    except OSError as err:  # a name too long for a path
        raise InputError(named_in or path, "profile", f"cannot be a path: {err.strerror}") from None
    if not exists:
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
        return join_field(path, m.group(1)), first[m.end() :]
    return path, msg
