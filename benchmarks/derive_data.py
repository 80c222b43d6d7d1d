"""Write pearl's shipped data (``pearl/data/``) from the raw public traces.

pearl ships compact files derived from the public traces, so that a clone runs without them
(formats: ``pearl/io/data_files.py``, ``docs/simulator.md`` "Data files"):

- ``agentic_workload.json``: the observations the simulator's trajectory model resamples
  (``pearl.io.traces.workload_observations``: TraceLab, SWE-agent, Azure and Mooncake), as
  sorted (value, count) runs; the turns keep their order.
- ``helios_windows.json``: every availability window of the Helios ``idle_gpu_num`` series
  (``pearl.sim.availability.windows_from_idle_series`` with ``min_duration_s`` 0; a
  scenario drops the short ones by its own ``min_duration_s``).

Reads ``../shared/traces`` (or ``--traces-dir``); writes into ``pearl/data`` (or ``--out``);
``--check`` writes nothing and exits 1 if a shipped file differs from what it would write.
Prints one JSON object: each file's name, size and whether it changed. Usage::

    .venv/bin/python benchmarks/derive_data.py [--traces-dir ../shared/traces] [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pearl.io.data_files import (
    SHIPPED_WINDOWS,
    SHIPPED_WORKLOAD,
    Source,
    render_windows,
    render_workload_samples,
)
from pearl.io.traces import HELIOS_VC, helios_windows, workload_observations

REPO = Path(__file__).resolve().parents[1]
COMMAND = ".venv/bin/python benchmarks/derive_data.py --traces-dir ../shared/traces"

# From ../shared/traces/README.md: repository @ commit, path, licence of each raw file.
TRACELAB = ("uw-syfi/TraceLab", "0b8a262b", "CC-BY-4.0")
WORKLOAD_SOURCES = [
    Source(
        repository=TRACELAB[0],
        commit=TRACELAB[1],
        path="replay/examples/multi_session_large.csv",
        licence=TRACELAB[2],
        used_for="turns_per_trajectory (rounds per session); observation_tokens (input_len "
        "of rounds >= 1)",
    ),
    Source(
        repository=TRACELAB[0],
        commit=TRACELAB[1],
        path="example_sessions/sanitized/round_trace.jsonl",
        licence=TRACELAB[2],
        used_for="observation_tokens (newly_append_tokens of rounds >= 1); tool_latency_s "
        "(wall time of each round's tools, first call to last result)",
    ),
    Source(
        repository="SWE-agent/SWE-agent",
        commit="3ea751c0",
        path="trajectories/.../marshmallow-1867_function_calling_replace_from_source.traj",
        licence="MIT",
        used_for="tool_latency_s (execution_time of each step; the pydicom-1458 trajectory "
        "of the same folder records none)",
    ),
    Source(
        repository="Azure/AzurePublicDataset",
        commit="b469a113",
        path="data/AzureLLMInferenceTrace_conv.csv",
        licence="CC-BY-4.0",
        used_for="prompt_tokens (ContextTokens); output_tokens (GeneratedTokens)",
    ),
    Source(
        repository="kvcache-ai/Mooncake",
        commit="3b5a5941",
        path="FAST25-release/traces/conversation_trace.jsonl",
        licence="Apache-2.0",
        used_for="prompt_tokens (input_length); output_tokens (output_length)",
    ),
]
HELIOS_SOURCE = Source(
    repository="S-Lab-System-Group/HeliosArtifact",
    commit="bdaae109",
    path="analysis/2_cluster characterization/Earth_vcs/vcpDC/cluster_sequence_vc.csv",
    licence="MIT",
    used_for="idle_gpu_num per minute of one 56-GPU virtual cluster of SenseTime's Helios",
)


def derived_files(traces_dir: Path) -> dict[str, str]:
    """The text of every shipped file, computed from the raw traces in ``traces_dir``."""
    workload = render_workload_samples(
        workload_observations(traces_dir),
        description="Observations of multi-turn agentic trajectories, pooled from public "
        "traces (rules: pearl/sim/trajectories.py); derived by counting, values unchanged.",
        sources=WORKLOAD_SOURCES,
        regenerate=COMMAND,
    )
    windows = render_windows(
        helios_windows(traces_dir / HELIOS_VC, gpu_type="-", min_duration_s=0.0),
        description="Whole 8-GPU nodes left idle in the Helios vcpDC series, one window per "
        "maximal run (rules: pearl/sim/availability.py), no minimum duration.",
        time_origin="the series' first row, 2020-05-01 00:00 (start_s 0)",
        sources=[HELIOS_SOURCE],
        regenerate=COMMAND,
    )
    return {SHIPPED_WORKLOAD: workload, SHIPPED_WINDOWS: windows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces-dir", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--out", type=Path, default=REPO / "pearl" / "data")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a change")
    args = parser.parse_args()
    if not (args.traces_dir / HELIOS_VC).is_file():
        print(f"{args.traces_dir}: no raw traces here (--traces-dir)", file=sys.stderr)
        return 2
    report = {}
    changed = False
    for name, text in derived_files(args.traces_dir).items():
        path = args.out / name
        same = path.is_file() and path.read_text(encoding="utf-8") == text
        changed |= not same
        if not args.check and not same:
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        report[name] = {"bytes": len(text.encode()), "changed": not same}
    print(json.dumps(report, indent=2))
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
