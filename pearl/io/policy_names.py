"""Policy and rule names checked as a document is loaded, not minutes into a run.

Apart from ``pearl.io.documents`` because it imports the decision core: commands that
only read documents (the node agent) start without it.
"""

from __future__ import annotations

from pathlib import Path

from pearl.core.config import PolicyConfig
from pearl.core.decide import POLICIES
from pearl.core.registry import UnknownName, check_names
from pearl.io.documents import InputError
from pearl.io.untrusted import join_field


def check_policy_names(cfg: PolicyConfig, path: str | Path, field: str = "") -> None:
    """Every policy and rule ``cfg`` names is registered: checked as the document that
    holds it is loaded, not minutes into a run (``field``: where ``cfg`` sits in it)."""
    try:
        check_names(cfg, POLICIES)
    except UnknownName as err:
        where, _, problem = str(err).partition(": ")
        raise InputError(path, join_field(field, where), problem) from None
