"""What the simulator's instances prefill per turn, by kind, on one policy's run (issue 18).

    .venv/bin/python benchmarks/turn_prefill.py [--scenario qwen3-30b-a3b-paper]
        [--tp 1] [--policy pearl] [--seed 0] [--duration-s 600]

The predictor's turn cycle charges a returning turn the tokens after its cached prefix
and a miss its whole context, at a prefix hit share per instance (``docs/predictor.md``,
"Prefix reuse"); this script counts what the step engine model
(``pearl.sim.engine.EngineModel``) computed instead. It wraps three of the model's
methods for the run (``from_profile`` to name each instance's group, ``_admit`` to count
what an admitted request still has to compute, ``_prefill_s`` and ``_single_step`` for
the time of the steps that carry prefill chunks; multi-step decode runs carry none) and
the fleet's ``route`` (whether a turn's home still took turns), and reports per group
(role, GPU type, TP):

- ``turns``: admitted requests by kind: ``fresh`` (a trajectory's first prefill
  anywhere), ``hit`` (a returning turn that computes at most half its prompt), and of
  those that compute more, ``evicted`` (on the instance its trajectory's previous
  admission was on: the prefix was evicted there), ``moved`` (elsewhere, routed away from
  a home that still took turns: the routing rule moved it) and ``rehomed`` (elsewhere,
  its home gone: the instance left or stopped accepting), ``kv_ready`` (a decode instance
  taking a prefill's KV);
- ``prefill_tokens`` by the same kinds, and ``recompute_share`` of the returning turns
  (evicted, moved and rehomed);
- ``prefill_s``: instance time in steps with prefill chunks, summed over the group, and
  ``stall_seq_s``: that time times the sequences decoding in those steps (what the
  prefills held the decodes up, colocated).

A preempted request admitted again counts as a returning turn. ``--tp`` holds the
scenario's rollout GPU type to that TP degree (``benchmarks/tp_check.py``'s restriction).
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

from held_run import held_run
from tp_check import path_of, restricted

from pearl.cli.flags import integer, positive_seconds
from pearl.io.scenarios import load_scenario_and_profile
from pearl.serving.requests import Request
from pearl.sim.engine import EngineModel, EngineStepResult
from pearl.sim.engine_base import Seq
from pearl.sim.fleet import Fleet, Instance

_groups: dict[int, str] = {}  # id(engine) -> group name
_counts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
_last_engine: dict[str, int] = {}  # trajectory -> id of the engine that last admitted it
_home_gone: set[str] = set()  # trajectories whose last route found their home gone
_last_prefill_s: dict[int, float] = {}


def _instrument() -> None:
    from_profile = EngineModel.from_profile.__func__  # type: ignore[attr-defined]
    route = Fleet.route
    admit, prefill_s, single_step = (
        EngineModel._admit,
        EngineModel._prefill_s,
        EngineModel._single_step,
    )

    def named(cls: type, role: Any, profile: Any, gpu_type: str, tp: int) -> EngineModel:
        engine: EngineModel = from_profile(cls, role, profile, gpu_type, tp)
        _groups[id(engine)] = f"{role.value}:{gpu_type}x{tp}"
        return engine

    def counted_admit(self: EngineModel, seq: Seq) -> None:
        admit(self, seq)
        todo = seq.num_tokens - seq.num_computed
        traj_id = seq.request.traj_id
        if seq.kv_ready_tokens:
            kind = "kv_ready"
        elif traj_id not in _last_engine:
            kind = "fresh"
        elif 2 * todo <= seq.num_tokens:
            kind = "hit"
        else:
            kind = "evicted" if _last_engine[traj_id] == id(self) else "moved"
            kind = "rehomed" if kind == "moved" and traj_id in _home_gone else kind
        _last_engine[traj_id] = id(self)
        counts = _counts[_groups.get(id(self), "?")]
        counts[f"turns.{kind}"] += 1
        counts[f"prefill_tokens.{kind}"] += todo

    def timed_prefill(self: EngineModel, chunks: list[tuple[Seq, int]]) -> float:
        duration_s = prefill_s(self, chunks)
        _last_prefill_s[id(self)] = duration_s
        return duration_s

    def timed_step(self: EngineModel) -> EngineStepResult:
        result = single_step(self)
        if result.num_prefill_tokens:
            counts = _counts[_groups.get(id(self), "?")]
            duration_s = _last_prefill_s.get(id(self), 0.0)
            counts["prefill_s"] += duration_s
            counts["stall_seq_s"] += duration_s * result.num_decode_seqs
        return result

    def routed(self: Fleet, request: Request) -> Instance | None:
        home = self.affinity.get(request.traj_id)
        if home is not None and not self.accepts(home.instance):
            _home_gone.add(request.traj_id)
        else:
            _home_gone.discard(request.traj_id)
        return route(self, request)

    Fleet.route = routed  # type: ignore[method-assign]
    EngineModel.from_profile = classmethod(named)  # type: ignore[method-assign,assignment]
    EngineModel._admit = counted_admit  # type: ignore[method-assign]
    EngineModel._prefill_s = timed_prefill  # type: ignore[method-assign]
    EngineModel._single_step = timed_step  # type: ignore[method-assign]


def _report(counts: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {"turns": {}, "prefill_tokens": {}}
    for key, value in sorted(counts.items()):
        part, _, kind = key.partition(".")
        if kind:
            out[part][kind] = int(value)
        else:
            out[key] = round(value, 1)
    turns = out["turns"]
    recomputed = sum(turns.get(kind, 0) for kind in ("evicted", "moved", "rehomed"))
    if recomputed + turns.get("hit", 0):
        out["recompute_share"] = round(recomputed / (recomputed + turns.get("hit", 0)), 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="qwen3-30b-a3b-paper")
    ap.add_argument("--tp", type=integer(1, 64), default=None)
    ap.add_argument("--policy", default="pearl")
    ap.add_argument("--seed", type=integer(0, 2**31 - 1), default=0)
    ap.add_argument("--duration-s", type=positive_seconds, default=600.0)
    args = ap.parse_args()
    scenario, profile = load_scenario_and_profile(path_of(args.scenario))
    scenario = scenario.model_copy(update={"duration_s": args.duration_s})
    profile = restricted(profile, scenario.cluster.rollout.gpu_type, args.tp)
    _instrument()
    figures, _ = held_run(scenario, profile, args.policy, args.seed)
    result = {
        "scenario": args.scenario,
        "tp": args.tp if args.tp is not None else "any",
        "policy": args.policy,
        "seed": args.seed,
        "duration_s": args.duration_s,
        **figures,
        "groups": {name: _report(c) for name, c in sorted(_counts.items())},
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
