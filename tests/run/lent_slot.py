"""The check of a lend's return under load, shared by the run tests: the steps that take
the engine on the trainer's slot off it (migrate, sleep, stop) leave no turn there."""

from __future__ import annotations

from typing import Any

LEAVES = ("migrate", "sleep", "stop")  # the steps that take an engine off its slot
ON_SLOT = "e-trainer"  # the engines on the trainer's slot


def check_returns(steps: list[dict[str, Any]], rollout: list[dict[str, Any]]) -> tuple[int, int]:
    """Each turn in flight on the slot's engine when a step took it off the slot went on
    elsewhere (served by it, then another) or ended there by that step's end; the turns the
    slot served, and those that went on elsewhere."""
    leaves = [s for s in steps if s["worker_id"].startswith(ON_SLOT) and s["action"] in LEAVES]
    turns = [r for r in rollout if r["type"] == "turn_ended"]
    on_slot = [t for t in turns if any(w.startswith(ON_SLOT) for w in t["served_by"])]
    moved = [t for t in on_slot if not t["served_by"][-1].startswith(ON_SLOT)]
    for leave in leaves:
        stayed = [
            t
            for t in on_slot
            if t["served_by"][-1].startswith(ON_SLOT)
            and t["started_t"] < leave["started_t"] < t["t"]
        ]
        assert all(t["t"] <= leave["t"] + 1.0 for t in stayed), (leave, stayed)
    return len(on_slot), len(moved)
