"""``pearl plan STATE_FILE``: one decision on a saved state, JSON on stdout, why on stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from pearl.core.config import PolicyConfig
from pearl.core.decide import POLICIES, decide
from pearl.core.observation import Observation
from pearl.core.registry import UnknownName, check_names
from pearl.core.state import ClusterState, Frozen
from pearl.io.documents import InputError, load_profile, parse, read_document
from pearl.io.encode import dumps


class PlanInput(Frozen):
    """A saved decision input: the state, what was observed, and the profile to use."""

    schema_version: Literal[1] = 1
    profile: Annotated[str, Field(min_length=1)] = Field(
        description="Shipped profile name (qwen3-8b, qwen3-30b-a3b) or a path next to this file."
    )
    now_s: Annotated[float, Field(ge=0)] = Field(description="Time of the decision.")
    state: ClusterState
    observation: Observation = Observation()


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="decide once on a saved state and print the decision")
    p.add_argument("state_file", type=Path, help="JSON or YAML plan input (see examples/states)")
    p.add_argument("--config", type=Path, help="policy config (YAML or JSON)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    doc = parse(PlanInput, read_document(args.state_file), args.state_file)
    cfg = PolicyConfig()
    if args.config is not None:
        cfg = parse(PolicyConfig, read_document(args.config) or {}, args.config)
        try:
            check_names(cfg, POLICIES)
        except UnknownName as err:
            field, _, problem = str(err).partition(": ")
            raise InputError(args.config, field, problem) from None
    profile = load_profile(
        doc.profile, relative_to=args.state_file.parent, named_in=args.state_file
    )
    decision = decide(doc.state, doc.observation, cfg, profile, doc.now_s)
    print(dumps(decision))
    print(decision.summary(), file=sys.stderr)
    return 0
