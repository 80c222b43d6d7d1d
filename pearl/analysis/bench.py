"""Speed of the analysis: a synthetic run log of ``events`` records, analysed end to end.

``synthetic_log`` writes a plausible run (schema ``docs/log-schema.md``): 64 base GPUs
(32 training, 32 rollout), repeated rollout batches of 512 trajectories each followed by
a training step, a decision every 64 trajectories, a transition with worker phases and
plan steps every other batch, borrow windows, and elastic allocations granted, preempted
and re-requested with their GPUs added and removed. Most records are
``trajectory_finished``, as in a real run.

``bench_analyze`` times ``pearl.analysis.report.analyze`` on it (read, summary, plots, report:
``wall_s``) and, separately, the streaming pass alone (``read_s``). The target (one core,
one million events, ``wall_s`` under 30 s) is in ``docs/analysis.md``; tests only check
the JSON's shape on a small log.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pearl.analysis.report import analyze
from pearl.analysis.runs import RunLog, analyze_log

BATCH = 512
TRAIN_GPUS = [f"train{n:03d}/{g}" for n in range(4) for g in range(8)]
ROLLOUT_GPUS = [f"roll{n:03d}/{g}" for n in range(4) for g in range(8)]


def _records(events: int) -> Iterator[dict[str, Any]]:
    """About ``events`` records of one synthetic run, in time order."""
    yield {
        "type": "run_started",
        "run_id": "bench",
        "source": "simulator",
        "policy": "pearl",
        "scenario": "bench",
        "seed": 0,
        "profile": "qwen3-8b",
    }
    for gpus, source in ((TRAIN_GPUS, "base-train"), (ROLLOUT_GPUS, "base-rollout")):
        for g in gpus:
            yield {
                "type": "gpu_added",
                "gpu_id": g,
                "node": g.split("/")[0],
                "gpu_type": "h100",
                "source": source,
                "allocation_id": "base",
            }
    count, batch, t = 64, 0, 0.0
    while count < events - 1:
        t0 = t
        lend = batch % 2 == 0
        if lend:
            yield {"type": "borrow", "kind": "lend", "gpu_ids": TRAIN_GPUS, "return_by_t": t + 200}
            yield {
                "type": "decision",
                "policy": "pearl",
                "pd_mode": "disaggregated",
                "target": "disaggregated 8P:24D [decode:h100x1 x24, prefill:h100x1 x8]",
                "switch": True,
                "mandatory": False,
                "predicted_current_s": 220.0,
                "predicted_target_s": 200.0,
                "transition_s": 5.0,
                "num_steps": 8,
                "borrow": "lend",
                "num_elastic_requests": 1,
                "reasons": ["switch: yes"],
            }
            for k in range(8):
                wid = f"e-{k}"
                yield {
                    "type": "worker_phase",
                    "worker_id": wid,
                    "kind": "engine",
                    "gpu_ids": [ROLLOUT_GPUS[k]],
                    "role": "prefill",
                    "phase": "switching",
                }
                yield {"type": "plan_step", "action": "switch", "worker_id": wid, "started_t": t}
                yield {
                    "type": "worker_phase",
                    "worker_id": wid,
                    "kind": "engine",
                    "gpu_ids": [ROLLOUT_GPUS[k]],
                    "role": "prefill",
                    "phase": "ready",
                }
            aid = f"el{batch:05d}"
            yield {
                "type": "allocation",
                "allocation_id": aid,
                "status": "requested",
                "gpu_type": "h100",
                "num_gpus": 8,
            }
            yield {
                "type": "allocation",
                "allocation_id": aid,
                "status": "granted",
                "gpu_type": "h100",
                "num_gpus": 8,
            }
            for k in range(8):
                yield {
                    "type": "gpu_added",
                    "gpu_id": f"{aid}/{k}",
                    "node": aid,
                    "gpu_type": "h100",
                    "source": "elastic",
                    "allocation_id": aid,
                }
            count += 38
        for i in range(BATCH):
            t = t0 + 0.4 * (i + 1)
            yield {
                "t": t,
                "type": "trajectory_finished",
                "traj_id": f"t{batch}-{i}",
                "batch_id": batch,
                "num_turns": 3,
                "output_tokens": 900 + i % 200,
                "min_policy_version": batch,
            }
            if i % 64 == 63:
                yield {
                    "t": t,
                    "type": "decision",
                    "policy": "pearl",
                    "pd_mode": "colocated",
                    "target": "colocated 32C [colocated:h100x1 x32]",
                    "switch": False,
                    "mandatory": False,
                    "predicted_current_s": 30.0,
                    "predicted_target_s": 30.0,
                    "transition_s": 0.0,
                    "num_steps": 0,
                    "borrow": "none",
                    "num_elastic_requests": 0,
                    "reasons": [],
                }
                count += 1
        count += BATCH
        yield {
            "t": t,
            "type": "batch_completed",
            "batch_id": batch,
            "started_t": t0,
            "predicted_s": 200.0,
        }
        if lend:
            aid = f"el{batch:05d}"
            yield {
                "t": t,
                "type": "borrow",
                "kind": "return",
                "gpu_ids": TRAIN_GPUS,
                "return_by_t": t + 5,
            }
            yield {"t": t + 2, "type": "borrow", "kind": "returned", "gpu_ids": TRAIN_GPUS}
            yield {
                "t": t + 2,
                "type": "allocation",
                "allocation_id": aid,
                "status": "preempting",
                "gpu_type": "h100",
                "num_gpus": 8,
            }
            yield {
                "t": t + 3,
                "type": "allocation",
                "allocation_id": aid,
                "status": "ended",
                "gpu_type": "h100",
                "num_gpus": 8,
            }
            for k in range(8):
                yield {
                    "t": t + 3,
                    "type": "gpu_removed",
                    "gpu_id": f"{aid}/{k}",
                    "reason": "preempted",
                }
            count += 12
        t += 30.0
        yield {
            "t": t,
            "type": "train_step",
            "step": batch,
            "started_t": t - 28.0,
            "policy_version": batch + 1,
            "waited_for_gpus_s": 2.0 if lend else 0.0,
        }
        count += 2
        batch += 1
    yield {"t": t, "type": "run_ended", "reason": "done"}


def synthetic_log(path: Path, events: int) -> int:
    """Write the synthetic run to ``path``; the number of records written."""
    n, t = 0, 0.0
    with path.open("w", encoding="utf-8") as f:
        for rec in _records(events):
            t = rec.pop("t", t)
            f.write(json.dumps({"v": 1, "t": t, **rec}, separators=(",", ":")) + "\n")
            n += 1
    return n


def bench_analyze(events: int = 1_000_000) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pearl-bench-analyze-") as tmp:
        log = Path(tmp) / "run" / "events.jsonl"
        log.parent.mkdir()
        written = synthetic_log(log, events)
        start = time.perf_counter()
        analyze_log(RunLog(log, "run")).summary()
        read_s = time.perf_counter() - start
        start = time.perf_counter()
        summary = analyze([log.parent], Path(tmp) / "report")
        wall_s = time.perf_counter() - start
        size_mb = log.stat().st_size / 1e6
    return {
        "events": written,
        "wall_s": round(wall_s, 3),
        "read_s": round(read_s, 3),
        "events_per_s": round(written / read_s),
        "log_mb": round(size_mb, 1),
        "records": summary["runs"][0]["read"]["records"],
        "plots": len(summary["plots"]),
    }
