"""Replacing a small file atomically: a reader sees the old document or the new, never half.

The text goes to a temporary file beside ``path`` (its name unique to this process and
call, so two writers never share one), is flushed and fsynced, then renamed over ``path``.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
