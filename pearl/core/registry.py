"""Everything a config picks by name: decision policies and the rules they combine.

One config selects the same code in the simulator and on the cluster. Unknown names are
rejected with the field and the known names (``check_names``), before any decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from pearl.core.config import PolicyConfig
from pearl.core.policies.borrowing import BORROW_RULES
from pearl.core.policies.elastic import ELASTIC_RULES
from pearl.core.policies.switching import SWITCH_RULES

T = TypeVar("T")


class UnknownName(ValueError):
    """A config names a policy or rule that is not registered."""


def lookup(table: Mapping[str, T], name: str, field: str) -> T:
    try:
        return table[name]
    except KeyError:
        known = ", ".join(sorted(table))
        raise UnknownName(f"{field}: unknown name {name!r} (known: {known})") from None


def check_names(cfg: PolicyConfig, policies: Mapping[str, object]) -> None:
    """Raise ``UnknownName`` for the first unknown name in the config."""
    lookup(policies, cfg.policy, "policy")
    lookup(SWITCH_RULES, cfg.switching.rule, "switching.rule")
    lookup(BORROW_RULES, cfg.borrowing.rule, "borrowing.rule")
    lookup(ELASTIC_RULES, cfg.elastic.rule, "elastic.rule")
