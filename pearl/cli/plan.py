"""``pearl plan STATE_FILE``: one decision on a saved state, JSON on stdout, why on stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from pearl.core.config import PolicyConfig
from pearl.core.decide import decide
from pearl.core.observation import (
    AllocationGranted,
    AllocationPending,
    Observation,
    event_problems,
)
from pearl.core.profile import RuntimeProfile
from pearl.core.state import ClusterState, Frozen
from pearl.io.documents import (
    InputError,
    load_profile,
    parse,
    read_document,
)
from pearl.io.encode import dumps
from pearl.io.policy_names import check_policy_names


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
        check_policy_names(cfg, args.config)
    profile = load_profile(
        doc.profile, relative_to=args.state_file.parent, named_in=args.state_file
    )
    _check_references(doc, cfg, profile, args)
    decision = decide(doc.state, doc.observation, cfg, profile, doc.now_s)
    print(dumps(decision))
    print(decision.summary(), file=sys.stderr)
    return 0


def _check_references(
    doc: PlanInput, cfg: PolicyConfig, profile: RuntimeProfile, args: argparse.Namespace
) -> None:
    """GPU types the profile does not know, and events naming what the state does not
    hold, refused (``event_problems``: the late ones are ignored, said on stderr)."""
    known = ", ".join(sorted(profile.gpus))
    typed = [(f"state.gpus[{i}].gpu_type", g.gpu_type) for i, g in enumerate(doc.state.gpus)]
    for i, ev in enumerate(doc.observation.events):
        if isinstance(ev, AllocationPending):
            typed.append((f"observation.events[{i}].gpu_type", ev.gpu_type))
        elif isinstance(ev, AllocationGranted):
            typed += [
                (f"observation.events[{i}].nodes[{j}].gpu_type", n.gpu_type)
                for j, n in enumerate(ev.nodes)
            ]
    for field, gpu_type in typed:
        if gpu_type not in profile.gpus:
            problem = f"GPU type {gpu_type!r} is not in profile {doc.profile} ({known})"
            raise InputError(args.state_file, field, problem)
    if cfg.elastic.rule != "never" and cfg.elastic.gpu_type not in profile.gpus:
        problem = f"{cfg.elastic.gpu_type!r} is not in profile {doc.profile} ({known})"
        raise InputError(args.config or "(default policy)", "elastic.gpu_type", problem)
    for p in event_problems(doc.state, doc.observation):
        if not p.late:
            raise InputError(args.state_file, f"observation.{p.field}", p.problem)
        print(f"pearl plan: ignored observation.{p.field}: {p.problem}", file=sys.stderr)
